#!/bin/sh
# Makes the Secrets' contents for a deployment into DIR (default: the current directory), for an overlay's
# secretGenerator to read (README.md): nats-users.env, a password per NATS user (loom.identity.nats_auth's roles) and
# for the cluster's routes, and api.env, the REST API's admin token. 48 hex characters each. Existing files
# are kept: delete them to make new ones. Keep DIR out of version control.
set -eu
dir="${1:-.}"
mkdir -p "$dir"
umask 077

random() {
  if command -v openssl >/dev/null 2>&1; then
    openssl rand -hex 24
  else
    python3 -c 'import secrets; print(secrets.token_hex(24))'
  fi
}

if [ ! -e "$dir/nats-users.env" ]; then
  for key in scheduler router rollout predictor envmgr reward trainer operator routes; do
    echo "$key=$(random)"
  done > "$dir/nats-users.env"
  echo "wrote $dir/nats-users.env"
else
  echo "kept $dir/nats-users.env"
fi
if [ ! -e "$dir/api.env" ]; then
  echo "admin-token=$(random)" > "$dir/api.env"
  echo "wrote $dir/api.env"
else
  echo "kept $dir/api.env"
fi
