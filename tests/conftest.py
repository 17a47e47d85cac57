"""Shared test set-up: 8 CPU devices for jax (set before jax is imported) and small datasets."""

from __future__ import annotations

import os

# Must precede the first `import jax` anywhere in the test session.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# gcsfs probes the endpoint over gRPC+TLS by default, which makes every emulator call take 60 s.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import numpy as np
import pytest


def random_sequences(
    seed: int, count: int, *, max_len: int = 300, vocab: int = 1000
) -> list[np.ndarray]:
    """Ragged token-id sequences with lengths in [1, max_len]."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(1, max_len + 1)) for _ in range(count)]


@pytest.fixture(scope="session")
def small_sequences() -> list[np.ndarray]:
    return random_sequences(0, 3000)


# -- cloud: object-store servers on 127.0.0.1 (tests/helpers/servers.py), started on first use --


@pytest.fixture(scope="session")
def gcs_emulator():
    """gcp-storage-emulator in memory (suffix ranges and listen backlog fixed), one bucket."""
    from helpers.servers import GcsEmulator

    with GcsEmulator(bucket="asyncflat-test") as emulator:
        yield emulator


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server, one bucket; fake credentials and no EC2 metadata probing meanwhile."""
    from helpers.servers import MOTO_ENV, MotoS3

    with pytest.MonkeyPatch.context() as patch:
        for name, value in MOTO_ENV.items():
            patch.setenv(name, value)
        with MotoS3(bucket="asyncflat-test") as server:
            yield server
