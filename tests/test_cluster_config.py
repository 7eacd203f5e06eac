"""cluster.yaml is a valid Ray cluster launcher config, checked offline with Ray's own autoscaler helpers."""
from __future__ import annotations

import copy
import re

import pytest
import yaml
from conftest import REPO
from ray.autoscaler._private.commands import _bootstrap_config
from ray.autoscaler._private.util import prepare_config, validate_config

TEXT = (REPO / "cluster.yaml").read_text()


def config() -> dict:
    return yaml.safe_load(TEXT)


def checked(cfg: dict) -> dict:
    prepared = prepare_config(copy.deepcopy(cfg))
    validate_config(prepared)
    return prepared


def documented_local_provider() -> dict:
    """The `provider` block the comments give for switching to your own machines."""
    lines = TEXT.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"#\s+provider:\s*$", line))
    block = []
    for line in lines[start:]:
        if not re.match(r"#\s{4,}\S", line):
            break
        block.append(line[1:])
    return yaml.safe_load("\n".join(block))["provider"]


def test_aws_config_validates_with_head_and_worker_types():
    cfg = checked(config())
    assert cfg["provider"]["type"] == "aws"
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types and len(types) >= 2
    assert all(t["resources"].get("CPU", 0) > 0 for t in types.values())
    assert types["rayrb.gpu"]["resources"]["GPU"] == 1
    setup = " ".join(cfg["setup_commands"])
    assert "torch==2.13.0" in setup and "download.pytorch.org/whl/cpu" in setup and "/mnt/rayrb" in setup
    starts = cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token" in c and "RAYRB_HOME=/mnt/rayrb" in c for c in starts)
    assert "ray stop" not in TEXT.replace("No `ray stop`", "")  # it kills every Ray process on a machine


def test_switching_to_a_local_provider_as_the_comments_say():
    cfg = config()
    cfg["provider"] = documented_local_provider()
    del cfg["available_node_types"], cfg["head_node_type"]
    boot = _bootstrap_config(cfg, no_config_cache=True)  # the full offline path of `ray up` for local
    validate_config(boot)
    assert boot["provider"]["type"] == "local" and boot["provider"]["worker_ips"] == ["10.0.0.2", "10.0.0.3"]


@pytest.mark.parametrize("breakage, error", [
    (lambda c: c.update(max_workers="six"), "'six' is not of type 'integer'"),
    (lambda c: c["available_node_types"]["rayrb.cpu"].update(resources={"CPU": "eight"}), "is not of type"),
    (lambda c: c.update(setup_comands=["true"]), "Additional properties are not allowed"),
    (lambda c: c.update(head_node_type="rayrb.headnode"), "must be one of `available_node_types`"),
    (lambda c: c["available_node_types"]["rayrb.cpu"].update(min_workers=9), "smaller than the sum of `min_workers`"),
])
def test_broken_variants_are_rejected(breakage, error):
    cfg = config()
    breakage(cfg)
    with pytest.raises(Exception, match=re.escape(error)):
        checked(cfg)


def test_unknown_provider_is_rejected():
    cfg = config()
    cfg["provider"]["type"] = "awz"
    with pytest.raises(Exception, match="awz"):
        _bootstrap_config(checked(cfg), no_config_cache=True)
