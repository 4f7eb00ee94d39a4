#!/bin/sh
# The sandboxes' Docker engine, in the pod of the environment manager or the reward service. The socket goes
# to the shared emptyDir, owned by the services' group; like the engine Loom starts itself
# (loom.sandbox.engine), it has no bridge and no iptables: sandboxes have no network.
set -eu
sock=/var/run/dind/docker.sock
export DOCKER_HOST="unix://$sock"
export DOCKER_TLS_CERTDIR=""
dockerd-entrypoint.sh dockerd --host="$DOCKER_HOST" --group="${DOCKER_GROUP:-10001}" \
  --iptables=false --bridge=none &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null; wait "$pid"; exit 0' TERM INT
until docker info >/dev/null 2>&1; do
  kill -0 "$pid" 2>/dev/null || { echo "dockerd exited" >&2; exit 1; }
  sleep 1
done
# The startup probe passes once the image is here; only then does the service's container start.
if [ -n "${SANDBOX_IMAGE_TAR:-}" ]; then
  docker load -i "$SANDBOX_IMAGE_TAR"
else
  until docker pull "$SANDBOX_IMAGE"; do
    echo "pulling $SANDBOX_IMAGE failed; again in 10 s" >&2
    sleep 10
  done
fi
wait "$pid"
