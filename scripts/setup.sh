#!/usr/bin/env bash
# Makes a machine ready to build and test: installs cmake (Pingora's zlib-ng
# needs it) and the framework test backends (PHP, Chromium, Django, Express)
# when missing, and makes sure the services the tests talk to
# answer: PostgreSQL on 127.0.0.1:5432 (user postgres, database test) and
# Redis on 127.0.0.1:6379. Starts (on a bare machine, installs) them.
set -euo pipefail

need_apt_update=1
apt_install() {
  if [ "$need_apt_update" = 1 ]; then apt-get update -qq; need_apt_update=0; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

command -v cmake >/dev/null 2>&1 || apt_install cmake
# The framework backends of proxy-bin/tests/frameworks.rs: PHP's built-in
# server (the Laravel stand-in), headless Chromium with its driver, Django
# and gunicorn (PyPI) and Express (npm, from the committed lock file).
command -v php >/dev/null 2>&1 || apt_install php-cli
command -v chromium >/dev/null 2>&1 || apt_install chromium
command -v chromedriver >/dev/null 2>&1 || apt_install chromium-driver
python3 -c 'import django' >/dev/null 2>&1 || python3 -m pip install --quiet 'django>=5.2,<6'
python3 -c 'import gunicorn' >/dev/null 2>&1 || python3 -m pip install --quiet 'gunicorn>=23'
express_dir="$(dirname "$0")/../proxy-bin/tests/frameworks/express"
[ -d "$express_dir/node_modules/express" ] || (cd "$express_dir" && npm ci --no-audit --no-fund --silent)
command -v redis-server >/dev/null 2>&1 || apt_install redis-server
# The Redis Cluster tests start three cluster-mode servers on free ports
# themselves and join them with `redis-cli --cluster create`.
command -v redis-cli >/dev/null 2>&1 || apt_install redis-tools
if ! command -v pg_ctlcluster >/dev/null 2>&1; then
  apt_install postgresql postgresql-client
  # The tests connect as postgres over loopback without a password.
  for hba in /etc/postgresql/*/main/pg_hba.conf; do
    sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
  done
fi

if ! pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; then
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  for _ in $(seq 1 30); do pg_isready -h 127.0.0.1 -p 5432 -q && break; sleep 1; done
  pg_isready -h 127.0.0.1 -p 5432
fi
psql -h 127.0.0.1 -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname = 'test'" postgres | grep -q 1 \
  || psql -h 127.0.0.1 -U postgres -c "CREATE DATABASE test" postgres

if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  for _ in $(seq 1 30); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 1; done
  redis-cli -h 127.0.0.1 -p 6379 ping
fi
