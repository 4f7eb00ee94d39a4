# One image for every Loom service; the service is chosen by the command (python -m services.<name>).
# Images cannot be pulled here: build the base from a Debian root filesystem first
#   debootstrap --variant=minbase bookworm rootfs && tar -C rootfs -c . | docker import - loom-base:bookworm
# (with python3 and python3-venv installed into rootfs), and a wheelhouse on the host:
#   pip wheel -w wheelhouse .
ARG BASE=loom-base:bookworm
FROM ${BASE}
COPY wheelhouse /wheelhouse
RUN python3 -m venv /opt/loom && /opt/loom/bin/pip install --no-index --find-links /wheelhouse loom \
    && rm -rf /wheelhouse
ENV PATH=/opt/loom/bin:$PATH PYTHONUNBUFFERED=1
RUN useradd --system --uid 10001 loom
USER loom
WORKDIR /home/loom
