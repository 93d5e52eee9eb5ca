"""docker-compose.s3.yml, statically (compose does not run here): the override gives the API and the
worker the same store settings, takes the shared artifacts volume away from both (they share only
Postgres, Redis and the store), creates the bucket the default URL names, and names only settings that
exist."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from app.core.settings import Settings

REPO = Path(__file__).resolve().parents[1]


class ComposeLoader(yaml.SafeLoader):
    """Compose's `!override` / `!reset` tags read as the plain values they carry."""


ComposeLoader.add_constructor("!override", lambda loader, node: loader.construct_sequence(node)
                              if isinstance(node, yaml.SequenceNode) else loader.construct_mapping(node))
ComposeLoader.add_constructor("!reset", lambda loader, node: None)


def load(name: str) -> dict[str, Any]:
    return yaml.load((REPO / name).read_text(), Loader=ComposeLoader)


def test_the_store_override_shares_no_volume_between_api_and_worker():
    base, store = load("docker-compose.yml"), load("docker-compose.s3.yml")
    api, worker = store["services"]["api"], store["services"]["worker"]
    assert api["environment"] == worker["environment"]
    env = api["environment"]
    assert env["DTP_LAYOUT_STORAGE_URL"].endswith("s3://dtp-layout/artifacts}")
    assert "mc mb --ignore-existing store/dtp-layout" in store["services"]["minio-bucket"]["command"][0]
    assert env["AWS_ENDPOINT_URL"].endswith("http://minio:9000}")
    api_volumes = {v.split(":")[0] for v in api["volumes"]}
    worker_volumes = {v.split(":")[0] for v in worker["volumes"]}
    assert "artifacts" in {v.split(":")[0] for v in base["services"]["api"]["volumes"]}  # the base shares it
    assert "artifacts" not in api_volumes | worker_volumes and "scratch" in worker_volumes
    assert not {"scratch"} & api_volumes
    assert "!override" in (REPO / "docker-compose.s3.yml").read_text()
    for volume in api_volumes | worker_volumes:
        assert volume in base["volumes"] or volume in store["volumes"], volume
    for name in env:
        if name.startswith("DTP_LAYOUT_"):
            assert name.removeprefix("DTP_LAYOUT_").lower() in Settings.model_fields, name
