#!/usr/bin/env bash
# Starts a throw-away PostgreSQL server on 127.0.0.1 (port $PGPORT, else a free one) for the
# shared storage test suite and prints two lines: the URL to use as STAGETREE_TEST_DB_URL
# and the server's data directory (stop it with `pg_ctl -D DIR stop`). Installs the server
# from Debian's packages when it is missing. Exits non-zero when no server could be started.
set -euo pipefail
port=${PGPORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
if [ -z "$bindir" ] || [ ! -x "$bindir/pg_ctl" ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql) >&2
  bindir=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
fi
data=$(mktemp -d /tmp/stagetree-pg.XXXXXX)
run() { if [ "$(id -u)" = 0 ]; then su postgres -s /bin/bash -c "$*"; else bash -c "$*"; fi; }
[ "$(id -u)" = 0 ] && chown postgres "$data"
run "$bindir/initdb -D $data -U postgres -A trust" >/dev/null
run "$bindir/pg_ctl -D $data -o '-p $port -k /tmp -c listen_addresses=127.0.0.1 -c fsync=off' -l $data/log -w start" >/dev/null
run "$bindir/createdb -h 127.0.0.1 -p $port -U postgres stagetree_test"
echo "postgresql://postgres@127.0.0.1:$port/stagetree_test"
echo "$data"
