"""scikit-learn's own small OpenML fixture files, laid out as a real scikit-learn cache.

They ship in scikit-learn's wheel; ids 2, 40675 and 40945 have integer-looking
nominal values that crash the pandas ARFF parser under pandas 3.
"""
from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path
from urllib.parse import urlparse

import sklearn

FIXTURES = Path(sklearn.__file__).parent / "datasets" / "tests" / "data" / "openml"


def build_cache(data_id: int, data_home: Path) -> dict:
    """Copy fixture ``data_id`` into ``data_home/openml/openml.org/...``; return its description."""
    src = FIXTURES / f"id_{data_id}"
    root = Path(data_home) / "openml" / "openml.org"
    desc = json.loads(gzip.open(src / f"api-v1-jd-{data_id}.json.gz").read())["data_set_description"]
    for f in src.iterdir():
        n = f.name
        if n.startswith("api-v1-jd-"):
            rel = f"api/v1/json/data/{data_id}"
        elif n.startswith("api-v1-jdf-"):
            rel = f"api/v1/json/data/features/{data_id}"
        elif n.startswith("api-v1-jdq-"):
            rel = f"api/v1/json/data/qualities/{data_id}"
        elif n.startswith("api-v1-jdl-dn-") and "-dv-" in n:
            name, version = n[len("api-v1-jdl-dn-"):-len(".json.gz")].split("-l-2-dv-")
            version = version.replace("-s-dact", "/status/deactivated")
            rel = f"api/v1/json/data/list/data_name/{name}/limit/2/data_version/{version}"
        elif n.startswith("data-v1-dl-"):
            rel = urlparse(desc["url"]).path.lstrip("/")
        else:
            continue
        dest = root / (rel + ".gz")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, dest)
    return desc
