"""deploy/k8s: the kustomize base and the GPU overlay render (``kubectl kustomize``), every object validates
against Kubernetes' schemas (``kubernetes-validate --strict``, as ``make test`` promises), and the rendered
objects keep what a deployment of Loom needs: a three-member JetStream cluster configured with Loom's own
users, probes on Loom's health check, replicas, GPU pools with their engines' flags, NetworkPolicies around
NATS, and no credential in the repository. The NATS configuration is rendered as a member's init container
renders it and run as a real three-member cluster on loopback ports."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from loom.identity.nats_auth import ROLES
from loom.runtime import bus
from loom.runtime.natsserver import container_config, find_binary
from loom.sandbox import stack_images
from loom.sandbox.images import DEFAULT_IMAGE

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBECTL = shutil.which("kubectl")
VALIDATE = Path(sys.executable).parent / "kubernetes-validate"
# Native sidecar containers (the Docker sidecar) are on by default from Kubernetes 1.29.
OLDEST_K8S = "1.29.0"
HEALTHCHECK = ["python3", "-m", "loom.runtime.healthcheck"]
# Serving, not only alive: compose's healthcheck and every readiness probe.
READY = [*HEALTHCHECK, "--ready"]
SECRET_KEYS = {*ROLES, "routes"}

pytestmark = pytest.mark.skipif(
    KUBECTL is None,
    reason="kubectl is not installed: its bundled kustomize renders deploy/k8s (the image's kubectl package has it)",
)

Obj = dict[str, Any]


def render(directory: Path) -> str:
    r = subprocess.run(
        [str(KUBECTL), "kustomize", str(directory)], capture_output=True, text=True, check=False, timeout=60
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def parse(text: str) -> list[Obj]:
    return [d for d in yaml.safe_load_all(text) if d]


def validate(text: str, version: str | None = None) -> None:
    """``kubernetes-validate --strict``: every object against the schemas of ``version`` (its default, the newest
    it knows, when None; one a call, as it reads standard input once). A kind it has no schema for is only a
    warning there; here it fails."""
    assert VALIDATE.exists(), "kubernetes-validate is missing from the venv: make install"
    args = ["-k", version] if version else []
    r = subprocess.run(
        [str(VALIDATE), "--strict", "--quiet", *args, "-"],
        input=text,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "ERROR" not in out and "WARN" not in out, out


@pytest.fixture(scope="module")
def gpu_text() -> str:
    return render(K8S / "overlays" / "gpu")


@pytest.fixture(scope="module")
def base_text() -> str:
    return render(K8S / "base")


@pytest.fixture(scope="module")
def gpu(gpu_text: str) -> list[Obj]:
    return parse(gpu_text)


@pytest.fixture(scope="module")
def base(base_text: str) -> list[Obj]:
    return parse(base_text)


def of_kind(objs: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def named(objs: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in of_kind(objs, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def config_map(objs: list[Obj], prefix: str) -> Obj:
    """A generated ConfigMap, by its name before kustomize's hash suffix."""
    found = [
        o
        for o in of_kind(objs, "ConfigMap")
        if re.fullmatch(rf"{prefix}(-[a-z0-9]{{10}})?", o["metadata"]["name"])
    ]
    assert len(found) == 1, prefix
    return found[0]


def workloads(objs: list[Obj]) -> list[Obj]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


def pod(o: Obj) -> Obj:
    return o["spec"]["template"]["spec"]


def containers(o: Obj) -> Iterator[Obj]:
    """Every container that runs for the pod's life: regular ones and native sidecars."""
    spec = pod(o)
    yield from spec["containers"]
    yield from (c for c in spec.get("initContainers", []) if c.get("restartPolicy") == "Always")


def env(container: Obj) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def secret_values(secret: Obj) -> dict[str, str]:
    out = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    out.update(secret.get("stringData") or {})
    return out


# -- the acceptance command ---------------------------------------------------------------------------------


def test_gpu_overlay_renders_and_validates_as_make_test_promises() -> None:
    """Acceptance: ``kubectl kustomize deploy/k8s/overlays/gpu | kubernetes-validate`` passes, strictly (no
    property Kubernetes does not know)."""
    assert VALIDATE.exists(), "kubernetes-validate is missing from the venv: make install"
    r = subprocess.run(
        f"'{KUBECTL}' kustomize '{K8S / 'overlays' / 'gpu'}' | '{VALIDATE}' --strict -",
        shell=True,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    passed = re.findall(r"^INFO - passed for resource (\S+) against version", r.stdout, re.MULTILINE)
    assert len(passed) >= 25 and "statefulset/loom-nats" in passed, r.stdout
    assert "WARN" not in r.stdout and "ERROR" not in r.stdout, r.stdout


def test_every_object_validates_on_the_oldest_supported_kubernetes(gpu_text: str, base_text: str) -> None:
    validate(gpu_text, OLDEST_K8S)
    validate(base_text)
    validate(base_text, OLDEST_K8S)


# -- NATS ---------------------------------------------------------------------------------------------------


def test_nats_is_a_three_member_jetstream_cluster_with_a_volume_each(gpu: list[Obj]) -> None:
    sts = named(gpu, "StatefulSet", "loom-nats")
    spec = sts["spec"]
    assert spec["replicas"] == 3
    assert spec["podManagementPolicy"] == "Parallel"
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"]
    (nats,) = pod(sts)["containers"]
    assert {"mountPath": "/data", "name": claim["metadata"]["name"]} in nats["volumeMounts"]
    assert {p["containerPort"] for p in nats["ports"]} == {4222, 6222, 8222}
    # compose's NATS healthcheck path, as the liveness probe.
    assert nats["livenessProbe"]["httpGet"]["path"] == "/healthz?js-enabled-only=true"
    assert nats["readinessProbe"]["httpGet"]["port"] == "monitor"
    headless = named(gpu, "Service", spec["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    # A member per node is required where it matters (the GPU overlay), else quorum dies with one node.
    (spread,) = pod(sts)["topologySpreadConstraints"]
    assert spread["whenUnsatisfiable"] == "DoNotSchedule"
    assert named(gpu, "PodDisruptionBudget", "loom-nats")["spec"]["maxUnavailable"] == 1

    conf = config_map(gpu, "loom-nats-config")["data"]["nats.conf"]
    # What Loom's own NATS container runs, verbatim, then the cluster.
    assert container_config() in conf
    routes = re.findall(r"nats-route://route:ROUTE_PASSWORD@([\w.-]+):6222", conf)
    assert routes == [f"loom-nats-{i}.{spec['serviceName']}" for i in range(3)]

    loom = config_map(gpu, "loom-config")["data"]
    assert loom["LOOM_NATS_URL"].split(",") == [f"nats://{host}:4222" for host in routes]
    assert loom["LOOM_JS_REPLICAS"] == "3"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _render_config(objs: list[Obj], passwords: dict[str, str], tmp: Path) -> Path:
    """What a NATS member's init container does: render.py from the ConfigMap, the Secret's keys as files."""
    data = config_map(objs, "loom-nats-config")["data"]
    (tmp / "template").mkdir(parents=True)
    (tmp / "users").mkdir()
    for name, text in data.items():
        (tmp / "template" / name).write_text(text)
    for key, value in passwords.items():
        (tmp / "users" / key).write_text(value)
    out = tmp / "nats.conf"
    r = subprocess.run(
        [
            sys.executable,
            str(tmp / "template" / "render.py"),
            str(tmp / "template" / "nats.conf"),
            str(tmp / "users"),
            str(out),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return out


def test_nats_refuses_to_start_on_the_example_secret(gpu: list[Obj], tmp_path: Path) -> None:
    data = config_map(gpu, "loom-nats-config")["data"]
    for name, text in data.items():
        (tmp_path / name).write_text(text)
    users = tmp_path / "users"
    users.mkdir()
    for key, value in secret_values(named(gpu, "Secret", "loom-nats-users")).items():
        (users / key).write_text(value)
    r = subprocess.run(
        [
            sys.executable,
            str(tmp_path / "render.py"),
            str(tmp_path / "nats.conf"),
            str(users),
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert r.returncode != 0 and "placeholder" in r.stderr
    assert not (tmp_path / "out").exists()


def test_the_rendered_nats_config_runs_a_jetstream_cluster_with_loom_users(
    gpu: list[Obj], tmp_path: Path
) -> None:
    """Three nats-servers from the configuration a member renders (only hosts, ports and paths moved to this
    machine): they form the cluster, authenticate their routes, and the scheduler's user creates a stream with
    three replicas."""
    passwords = {k: f"{k}-{'x' * 20}" for k in SECRET_KEYS}
    conf = _render_config(gpu, passwords, tmp_path).read_text()
    binary = find_binary()
    r = subprocess.run(
        [binary, "-c", str(tmp_path / "nats.conf"), "-t"],
        capture_output=True,
        text=True,
        env={"POD_NAME": "loom-nats-0"},
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr

    ports = _free_ports(9)
    client, route, monitor = ports[0:3], ports[3:6], ports[6:9]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(3):
            member = conf
            for j in range(3):
                member = member.replace(f"loom-nats-{j}.loom-nats-headless:6222", f"127.0.0.1:{route[j]}")
            member = (
                member.replace("\nport: 4222\n", f"\nport: {client[i]}\n")
                .replace("  port: 6222\n", f"  port: {route[i]}\n")
                .replace("http_port: 8222", f"http_port: {monitor[i]}")
                .replace('store_dir: "/data"', f'store_dir: "{tmp_path / f"js{i}"}"')
                .replace("/var/run/nats/nats.pid", str(tmp_path / f"nats{i}.pid"))
                .replace('host: "0.0.0.0"', 'host: "127.0.0.1"')
            )
            path = tmp_path / f"member{i}.conf"
            path.write_text(member)
            log = open(tmp_path / f"member{i}.log", "wb")  # noqa: SIM115 - handed to the server
            procs.append(
                subprocess.Popen(
                    [binary, "-c", str(path)], stdout=log, stderr=log, env={"POD_NAME": f"loom-nats-{i}"}
                )
            )
            log.close()
        deadline = time.monotonic() + 20
        healthy: set[int] = set()
        while len(healthy) < 3 and time.monotonic() < deadline:
            for i in set(range(3)) - healthy:
                try:
                    # Full health: JetStream current with the cluster's meta leader, as the startup probe asks.
                    urllib.request.urlopen(f"http://127.0.0.1:{monitor[i]}/healthz", timeout=2)
                    healthy.add(i)
                except OSError:
                    pass
            time.sleep(0.2)
        assert healthy == {0, 1, 2}, [(tmp_path / f"member{i}.log").read_text()[-2000:] for i in range(3)]
        url = ",".join(f"nats://127.0.0.1:{p}" for p in client)
        replicas = asyncio.run(_replicated_stream(url, passwords["scheduler"]))
        assert replicas == (3, 2)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


async def _replicated_stream(url: str, password: str) -> tuple[int, int]:
    from nats.errors import Error as NatsError
    from nats.js.api import StreamConfig

    nc = await bus.connect(url, "k8s-test", credentials=("scheduler", password), max_reconnect_attempts=0)
    try:
        js = nc.jetstream()
        last: Exception | None = None
        for _ in range(50):  # the meta leader may still be settling
            try:
                info = await js.add_stream(
                    StreamConfig(name="K8S_TEST", subjects=["loom.v1.results.k8s-test"], num_replicas=3)
                )
                break
            except NatsError as e:
                last = e
                await asyncio.sleep(0.2)
        else:
            raise AssertionError(f"no stream with three replicas: {last!r}")
        assert info.cluster is not None
        return info.config.num_replicas or 0, len(info.cluster.replicas or [])
    finally:
        await nc.close()


# -- the services -------------------------------------------------------------------------------------------


def compose_healthcheck() -> list[str]:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    test = compose["services"]["scheduler"]["healthcheck"]["test"]
    assert test[0] == "CMD"
    return list(test[1:])


def test_every_loom_workload_has_probes_resources_and_a_locked_down_pod(
    gpu: list[Obj], base: list[Obj]
) -> None:
    assert compose_healthcheck() == READY
    for objs in (gpu, base):
        loaded = workloads(objs)
        assert len(loaded) >= 7
        for w in loaded:
            name = w["metadata"]["name"]
            spec = pod(w)
            labels = w["spec"]["template"]["metadata"]["labels"]
            # What the NetworkPolicies admit to NATS.
            assert labels["app.kubernetes.io/part-of"] == "loom", name
            assert spec["automountServiceAccountToken"] is False, name
            # A Service named loom-scheduler would otherwise set LOOM_SCHEDULER_PORT=tcp://... in every pod.
            assert spec["enableServiceLinks"] is False, name
            for c in containers(w):
                where = f"{name}/{c['name']}"
                assert "readinessProbe" in c and "livenessProbe" in c, where
                requests = c["resources"]["requests"]
                assert requests["cpu"] and requests["memory"], where
                assert c["resources"]["limits"]["memory"], where
                if c["image"].split(":")[0].endswith("loom"):
                    # Loom's services: compose's health check for readiness; alive (answering) for the rest, so
                    # that a worker loading its model is neither killed nor sent to.
                    assert c["readinessProbe"]["exec"]["command"] == READY, where
                    for probe in ("startupProbe", "livenessProbe"):
                        assert c[probe]["exec"]["command"] == HEALTHCHECK, where
                    sc = c["securityContext"]
                    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, (
                        where
                    )
                    assert sc["capabilities"]["drop"] == ["ALL"], where
                    user = sc.get("runAsUser", spec["securityContext"].get("runAsUser"))
                    assert user == stack_images.SERVICE_UID, where
                    # Its own role's NATS user and password file, as in compose.
                    e = env(c)
                    assert e["LOOM_NATS_PASSWORD_FILE"] == f"/secrets/{e['LOOM_NATS_USER']}.password", where
                    assert e["LOOM_NATS_USER"] in ROLES, where


def test_scheduler_and_router_are_replicated_and_the_api_has_a_service(gpu: list[Obj]) -> None:
    for name in ("scheduler", "router", "predictor", "envmgr", "reward"):
        d = named(gpu, "Deployment", f"loom-{name}")
        assert d["spec"]["replicas"] >= 2, name
        assert d["spec"]["template"]["spec"]["containers"][0]["command"] == [
            "python3",
            "-m",
            f"services.{name}",
        ]
    for name in ("scheduler", "router"):
        assert named(gpu, "PodDisruptionBudget", f"loom-{name}")["spec"]["minAvailable"] == 1
    api = named(gpu, "Service", "loom-scheduler")
    assert api["spec"]["ports"][0]["port"] == 8080
    sched = named(gpu, "Deployment", "loom-scheduler")["spec"]["template"]["spec"]["containers"][0]
    e = env(sched)
    assert e["LOOM_SCHEDULER_HOST"] == "0.0.0.0" and e["LOOM_SCHEDULER_PORT"] == "8080"
    assert e["LOOM_API_TOKEN"] == {"secretKeyRef": {"name": "loom-api", "key": "admin-token"}}


def test_the_base_runs_without_gpus_or_privileges(base: list[Obj]) -> None:
    sim = named(base, "Deployment", "loom-rollout-sim")
    assert env(pod(sim)["containers"][0])["LOOM_ROLLOUT_ENGINE"] == "sim"
    ns = named(base, "Namespace", "loom")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for w in workloads(base):
        spec = pod(w)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for c in [*spec["containers"], *spec.get("initContainers", [])]:
            assert "nvidia.com/gpu" not in c["resources"].get("requests", {})
            assert not c["securityContext"].get("privileged"), c["name"]
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]


# -- the GPU pools ------------------------------------------------------------------------------------------


def test_every_gpu_worker_drives_an_engine_on_the_gpus_its_pod_requests(gpu: list[Obj]) -> None:
    assert not [o for o in gpu if o["metadata"]["name"] == "loom-rollout-sim"]
    pools = [
        d
        for d in of_kind(gpu, "Deployment")
        if d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "rollout"
    ]
    assert {d["metadata"]["name"] for d in pools} >= {"loom-rollout-h100", "loom-rollout-a100"}
    engines = set()
    for d in pools:
        spec = pod(d)
        name = d["metadata"]["name"]
        assert spec["nodeSelector"]["nvidia.com/gpu.product"], name
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"]), name
        worker = next(c for c in spec["containers"] if c["name"] == "worker")
        (engine,) = [c for c in spec["containers"] if c is not worker]
        gpus = engine["resources"]["requests"]["nvidia.com/gpu"]
        assert gpus >= 1 and engine["resources"]["limits"]["nvidia.com/gpu"] == gpus, name
        e = env(worker)
        kind = e["LOOM_ROLLOUT_ENGINE"]
        engines.add(kind)
        assert e["LOOM_ROLLOUT_WORKER_ID"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert e["LOOM_ROLLOUT_TP"] == str(gpus)
        args = engine["args"]
        port = args[args.index("--port") + 1]
        assert args[args.index("--host") + 1] == "127.0.0.1"
        if kind == "sglang":
            assert e["LOOM_ROLLOUT_SGLANG_URL"] == f"http://127.0.0.1:{port}" == "http://127.0.0.1:30000"
            # loom.engine.clients.sglang's docstring: what the server must run with.
            assert {"--enable-metrics", "--enable-priority-scheduling"} <= set(args)
            assert args[args.index("--tp-size") + 1] == str(gpus)
        else:
            assert kind == "vllm"
            assert e["LOOM_ROLLOUT_VLLM_URL"] == f"http://127.0.0.1:{port}"
            # loom.engine.clients.vllm's docstring: `VLLM_SERVER_DEV_MODE=1 vllm serve CKPT --scheduling-policy
            # priority --logprobs-mode processed_logprobs --enable-per-request-metrics --enable-prompt-tokens-details`
            flags = " ".join(args)
            for flag in (
                "--scheduling-policy priority",
                "--logprobs-mode processed_logprobs",
                "--enable-per-request-metrics",
                "--enable-prompt-tokens-details",
            ):
                assert flag in flags
            assert env(engine)["VLLM_SERVER_DEV_MODE"] == "1"
            assert args[args.index("--tensor-parallel-size") + 1] == str(gpus)
        # Weights: every engine reads checkpoints at the path the trainer names, from the shared volume.
        mounts = {m["mountPath"]: m for m in engine["volumeMounts"]}
        assert mounts["/checkpoints"]["readOnly"] is True
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert (
            volumes[mounts["/checkpoints"]["name"]]["persistentVolumeClaim"]["claimName"]
            == "loom-checkpoints"
        )
    assert engines == {"sglang", "vllm"}
    claim = named(gpu, "PersistentVolumeClaim", "loom-checkpoints")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_envmgr_and_reward_get_a_docker_engine_for_their_sandboxes(gpu: list[Obj]) -> None:
    sandbox = config_map(gpu, "loom-sandbox")["data"]
    # The image `loom images build` makes, from the registry.
    assert sandbox["image"].rsplit("/", 1)[-1] == DEFAULT_IMAGE
    for name, prefix in (("envmgr", "ENVMGR"), ("reward", "REWARD")):
        spec = pod(named(gpu, "Deployment", f"loom-{name}"))
        (dind,) = spec["initContainers"]
        assert dind["restartPolicy"] == "Always" and "startupProbe" in dind
        e = env(spec["containers"][0])
        assert e["DOCKER_HOST"] == "unix:///var/run/dind/docker.sock"
        assert e[f"LOOM_{prefix}_SANDBOX_BACKEND"] == "docker"
        assert e[f"LOOM_{prefix}_SANDBOX_IMAGE"]["configMapKeyRef"]["key"] == "image"
        # The service itself stays non-root: the socket belongs to its group.
        assert spec["securityContext"]["runAsUser"] == stack_images.SERVICE_UID
        assert env(dind)["DOCKER_GROUP"] == str(stack_images.SERVICE_UID)


# -- network ------------------------------------------------------------------------------------------------


def test_network_policies_let_only_loom_reach_nats(gpu: list[Obj]) -> None:
    policies = of_kind(gpu, "NetworkPolicy")
    deny = [p for p in policies if p["spec"]["podSelector"] == {} and "ingress" not in p["spec"]]
    assert deny and deny[0]["spec"]["policyTypes"] == ["Ingress"]
    nats_labels = named(gpu, "StatefulSet", "loom-nats")["spec"]["template"]["metadata"]["labels"]
    selecting_nats = [
        p
        for p in policies
        if p["spec"]["podSelector"]
        and all(nats_labels.get(k) == v for k, v in p["spec"]["podSelector"]["matchLabels"].items())
    ]
    assert selecting_nats
    admitted: dict[int, list[Obj]] = {}
    for p in selecting_nats:
        for rule in p["spec"]["ingress"]:
            for port in rule["ports"]:
                admitted.setdefault(port["port"], []).extend(rule["from"])
    assert set(admitted) == {4222, 6222}
    for peer in admitted[4222]:
        # Pods only, each by a label of Loom's or a trainer's: no address ranges, no "everyone".
        assert "ipBlock" not in peer and peer.get("podSelector", {}).get("matchLabels"), peer
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "loom"}}} in admitted[4222]
    assert admitted[6222] == [
        {
            "podSelector": {
                "matchLabels": {
                    k: nats_labels[k] for k in ("app.kubernetes.io/name", "app.kubernetes.io/component")
                }
            }
        }
    ]
    # Every Loom pod carries the label the client rule admits.
    for w in workloads(gpu):
        assert w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "loom"
    api = named(gpu, "NetworkPolicy", "loom-scheduler-api")
    assert [p["port"] for r in api["spec"]["ingress"] for p in r["ports"]] == [8080]


# -- secrets and images -------------------------------------------------------------------------------------

# A real-looking credential: 16 or more characters without a placeholder word in them.
PLACEHOLDER = re.compile(r"REPLACE", re.IGNORECASE)


def test_no_secret_holds_a_real_looking_credential(gpu: list[Obj], base: list[Obj]) -> None:
    for objs in (gpu, base):
        secrets = {s["metadata"]["name"]: secret_values(s) for s in of_kind(objs, "Secret")}
        assert set(secrets) == {"loom-nats-users", "loom-api"}
        assert set(secrets["loom-nats-users"]) == SECRET_KEYS
        assert set(secrets["loom-api"]) == {"admin-token", "tenants.json"}
        assert json.loads(secrets["loom-api"]["tenants.json"]) == {"tenants": {}}
        for name, values in secrets.items():
            for key, value in values.items():
                if key == "tenants.json":
                    continue
                assert PLACEHOLDER.search(value) and len(value) < 16, (
                    f"{name}/{key} looks like a real credential"
                )
    # Nor does any other file of deploy/k8s: nothing long and random where a secret could go.
    for path in K8S.rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert not re.search(r"\b[0-9a-f]{32,}\b", text), path
            assert not re.search(
                r"(password|token)\s*[:=]\s*['\"]?[A-Za-z0-9_-]{16,}", text, re.IGNORECASE
            ), path


def test_images_are_set_in_one_place_and_name_no_registry_host(gpu: list[Obj], base: list[Obj]) -> None:
    version = stack_images.version()
    base_images = {
        c["image"]
        for w in workloads(base)
        for c in [*pod(w)["containers"], *pod(w).get("initContainers", [])]
    }
    # What `loom images build` makes, by the Loom release.
    assert base_images == {f"{stack_images.SERVICES_REPO}:{version}", f"{stack_images.NATS_REPO}:{version}"}
    gpu_images = {
        c["image"] for w in workloads(gpu) for c in [*pod(w)["containers"], *pod(w).get("initContainers", [])]
    }
    gpu_images.add(config_map(gpu, "loom-sandbox")["data"]["image"])
    assert f"REGISTRY/{stack_images.SERVICES_REPO}:{version}" in gpu_images
    for image in gpu_images:
        # REGISTRY is the placeholder for the user's registry; no real host is named.
        assert image.split("/", 1)[0] == "REGISTRY", image


def test_a_users_overlay_with_made_secrets_renders_as_the_readme_says(tmp_path: Path) -> None:
    """The README's steps, run: make-secrets.sh into an overlay of one's own and the README's kustomization
    for it; the Secrets are then the made ones, which NATS's render accepts."""
    shutil.copytree(K8S, tmp_path / "k8s")
    mine = tmp_path / "k8s" / "overlays" / "mine"
    mine.mkdir()
    r = subprocess.run(
        ["sh", str(tmp_path / "k8s" / "make-secrets.sh"), str(mine)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    readme = (K8S / "README.md").read_text()
    block = readme.split("`deploy/k8s/overlays/mine/kustomization.yaml`:", 1)[1]
    kustomization = block.split("```yaml\n", 1)[1].split("```", 1)[0]
    (mine / "kustomization.yaml").write_text(kustomization)
    text = render(mine)
    validate(text)
    objs = parse(text)
    made = dict(line.split("=", 1) for line in (mine / "nats-users.env").read_text().split())
    assert set(made) == SECRET_KEYS
    users = secret_values(named(objs, "Secret", "loom-nats-users"))
    assert users == made
    assert all(re.fullmatch(r"[0-9a-f]{48}", v) for v in made.values())
    api = secret_values(named(objs, "Secret", "loom-api"))
    assert len(api["admin-token"]) == 48 and json.loads(api["tenants.json"]) == {"tenants": {}}
    conf = _render_config(objs, users, tmp_path / "render").read_text()
    assert "ROUTE_PASSWORD" not in conf and made["routes"] in conf
    assert all(f'"user": "{role}"' in conf for role in ROLES)
    # Run again, it keeps what it made.
    subprocess.run(
        ["sh", str(tmp_path / "k8s" / "make-secrets.sh"), str(mine)],
        capture_output=True,
        check=True,
        timeout=60,
    )
    assert dict(line.split("=", 1) for line in (mine / "nats-users.env").read_text().split()) == made
