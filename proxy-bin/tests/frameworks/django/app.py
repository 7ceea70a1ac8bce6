"""The seed's contact form as a real Django app, for the proxy's tests.

One file: settings, model, form, views and URLs. The model has NO unique
constraint on ``submission_token``: behind ``idempotency-proxy`` the proxy
alone must make each submission take effect once. Django's own habits are
kept: CSRF protection on, an invalid form is re-rendered with 200 (errors and
the entered values, the same hidden token), a valid one redirects (302) to
the thanks page.

Run: ``python3 app.py PORT DB_PATH`` (``runserver``, threaded, no reloader;
with ``SERVER=gunicorn``, under gunicorn);
``SUBMIT_DELAY_MS`` slows each accepted submission down (default 20).
``GET /_stats`` answers the record and notification counts as JSON, for the
tests only.
"""

import os
import sys
import time
import uuid

import django
from django.conf import settings

PORT = sys.argv[1] if len(sys.argv) > 1 else "8000"
DB_PATH = sys.argv[2] if len(sys.argv) > 2 else ":memory:"
# Each accepted submission takes this long (so a double click overlaps it).
SUBMIT_DELAY = int(os.environ.get("SUBMIT_DELAY_MS", "20")) / 1000

settings.configure(
    DEBUG=False,
    SECRET_KEY="test-only-secret-key-not-for-production",
    ALLOWED_HOSTS=["*"],
    ROOT_URLCONF=__name__,
    INSTALLED_APPS=["django.contrib.contenttypes", "contact_app"],
    MIDDLEWARE=[
        "django.middleware.common.CommonMiddleware",
        "django.middleware.csrf.CsrfViewMiddleware",
    ],
    DATABASES={
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": DB_PATH,
            "OPTIONS": {"timeout": 20},
        }
    },
    DEFAULT_AUTO_FIELD="django.db.models.AutoField",
    TEMPLATES=[{"BACKEND": "django.template.backends.django.DjangoTemplates"}],
    USE_TZ=True,
)

# The app package lives beside this file.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
django.setup()

from django import forms  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.http import JsonResponse  # noqa: E402
from django.shortcuts import redirect  # noqa: E402
from django.template import Context, RequestContext, Template  # noqa: E402
from django.http import HttpResponse  # noqa: E402
from django.urls import path  # noqa: E402

from contact_app.models import ContactRequest, Notification  # noqa: E402


class ContactForm(forms.Form):
    submission_token = forms.UUIDField()
    email = forms.EmailField()
    message = forms.CharField(max_length=5000)


FORM = Template(
    """<!doctype html>
<html><head><title>Contact</title></head><body>
<h1>Contact</h1>
{% if form.errors %}<ul class="errors">{% for field, errors in form.errors.items %}{% for e in errors %}<li>{{ field }}: {{ e }}</li>{% endfor %}{% endfor %}</ul>{% endif %}
<form method="post" action="/contact">{% csrf_token %}
<input type="hidden" name="submission_token" value="{{ token }}">
<input type="email" name="email" id="email" value="{{ email }}">
<textarea name="message" id="message">{{ message }}</textarea>
<button type="submit" id="send">Send</button>
</form></body></html>"""
)

THANKS = Template("<!doctype html><html><body><h1>Thanks</h1></body></html>")


def contact(request, thanks="/contact/thanks"):
    if request.method == "POST":
        form = ContactForm(request.POST)
        if form.is_valid():
            data = form.cleaned_data
            time.sleep(SUBMIT_DELAY)
            with transaction.atomic():
                record = ContactRequest.objects.create(
                    submission_token=str(data["submission_token"]),
                    email=data["email"],
                    message=data["message"],
                )
                Notification.objects.create(contact_request=record)
            return redirect(thanks)
        # Django's way: the invalid form is rendered again, with 200.
        token = request.POST.get("submission_token") or str(uuid.uuid4())
        email = request.POST.get("email", "")
        message = request.POST.get("message", "")
    else:
        form = ContactForm()
        token, email, message = str(uuid.uuid4()), "", ""
    context = {"form": form, "token": token, "email": email, "message": message}
    return HttpResponse(FORM.render(RequestContext(request, context)))


def thanks(request):
    return HttpResponse(THANKS.render(Context({})))


def stats(request):
    tokens = {}
    for row in ContactRequest.objects.all():
        tokens[row.submission_token] = tokens.get(row.submission_token, 0) + 1
    return JsonResponse(
        {
            "records": ContactRequest.objects.count(),
            "notifications": Notification.objects.count(),
            "tokens": tokens,
            "emails": [row.email for row in ContactRequest.objects.order_by("id")],
        }
    )


urlpatterns = [
    path("contact", contact),
    path("contact/thanks", thanks),
    # The German seed's form, whose thanks page is not ASCII: Django sends
    # its Location escaped (`/kontakt/best%C3%A4tigt`).
    path("kontakt", contact, {"thanks": "/kontakt/bestätigt"}),
    path("kontakt/bestätigt", thanks),
    # Written with a trailing slash, as Django's own tutorials write
    # routes: CommonMiddleware (APPEND_SLASH) answers `POST /signup` with a
    # 301 to `/signup/` before any view runs.
    path("signup/", contact),
    path("_stats", stats),
]


if __name__ == "__main__":
    from django.core.management import call_command

    call_command("migrate", run_syncdb=True, verbosity=0)
    connection.close()
    if os.environ.get("SERVER") == "gunicorn":
        # Django as it is deployed: under gunicorn, which trusts the proxy
        # on 127.0.0.1 (`forwarded_allow_ips`) to set SCRIPT_NAME by a
        # header of that name, and routes by the rest of the path.
        from django.core.wsgi import get_wsgi_application
        from gunicorn.app.base import BaseApplication

        class Gunicorn(BaseApplication):
            def load_config(self):
                self.cfg.set("bind", f"127.0.0.1:{PORT}")
                self.cfg.set("workers", 1)
                self.cfg.set("threads", 8)

            def load(self):
                return get_wsgi_application()

        Gunicorn().run()
    else:
        call_command("runserver", f"127.0.0.1:{PORT}", use_reloader=False, use_threading=True)
