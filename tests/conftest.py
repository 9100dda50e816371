"""Shared fixtures: an S3 service on 127.0.0.1 (moto in server mode) for the checkpoint
store suite and the end-to-end S3 study; deterministic torch for the fused-vs-unfused
modules (the only conftest: a second one in a subfolder would shadow this module).

Also puts ``tests/fakes`` (the shared trainers and fakes) on ``sys.path``, so that every
test folder imports them by bare name (``from study_trainers import LinearTrainer``)."""

from __future__ import annotations

import os
import secrets
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

FAKES = Path(__file__).resolve().parent / "fakes"
if str(FAKES) not in sys.path:
    sys.path.insert(0, str(FAKES))


@dataclass(frozen=True)
class S3Service:
    """A moto S3 server: its endpoint, and a bucket made for the session."""

    endpoint: str
    bucket: str

    def url(self, prefix: str | None = None) -> str:
        """A fresh ``s3://bucket/prefix`` URL."""
        return f"s3://{self.bucket}/{prefix or secrets.token_hex(6)}"

    @property
    def options(self) -> dict[str, object]:
        """fsspec storage options that reach this server."""
        return {"client_kwargs": {"endpoint_url": self.endpoint}}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on (now)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Service]:
    """moto's S3 in server mode on a free port of 127.0.0.1, reached through s3fs.

    The AWS variables (fake credentials, ``AWS_ENDPOINT_URL``) are set for the session
    so that worker processes reach the same server; they are restored at the end."""
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    import boto3

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=free_port())
    saved = {k: os.environ.get(k) for k in [*_AWS_ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update(_AWS_ENV)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        bucket = "stagetree-test"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        yield S3Service(endpoint, bucket)
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def fused_vs_unfused_determinism() -> Iterator[None]:
    """Deterministic kernels on one thread, with TF32 off, for a module that compares
    fused members with members trained alone.

    TF32 convolutions would make fused (grouped) and unfused convolutions round
    differently on GPUs that have it. warn_only: some batched kernels fusion picks on
    CUDA may have no deterministic implementation, and fused-vs-unfused comparisons do
    not need one (the bit-for-bit comparisons are of unfused runs)."""
    torch = pytest.importorskip("torch")
    from stagetree.torch import deterministic

    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    with deterministic(threads=1, warn_only=True):
        yield
    torch.backends.cudnn.allow_tf32 = tf32


@pytest.fixture(params=["sqlite", "postgres"])
def sql_plan_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A plan database URL per SQL backend: a fresh SQLite file, or the PostgreSQL
    database of ``STAGETREE_TEST_DB_URL`` emptied first (skipped when unset)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'plan.db'}"
        return
    url = os.environ.get("STAGETREE_TEST_DB_URL")
    if not url:
        pytest.skip("set STAGETREE_TEST_DB_URL to run the PostgreSQL backend")
    from stagetree.plan.sql import SQLPlanStorage  # the root conftest imports no stagetree

    fresh = SQLPlanStorage(url)
    fresh.drop_all()
    fresh.close()
    yield url
