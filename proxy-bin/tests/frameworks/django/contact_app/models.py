from django.db import models


class ContactRequest(models.Model):
    # Deliberately no unique constraint: the proxy alone holds the guarantee.
    submission_token = models.CharField(max_length=64)
    email = models.EmailField()
    message = models.TextField()


class Notification(models.Model):
    contact_request = models.ForeignKey(ContactRequest, on_delete=models.CASCADE)
