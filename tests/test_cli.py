import json

import numpy as np
import pytest

from rayrb.chunks import write_dataset
from rayrb.cli import main


def test_info_verify_export(tmp_path, capsys):
    write_dataset({"x": np.arange(6, dtype=np.float32)}, tmp_path / "ds", chunk_rows=4)
    assert main(["info", str(tmp_path / "ds")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["rows"] == 6 and info["chunks"] == 2
    assert main(["verify", str(tmp_path / "ds")]) == 0
    assert main(["export-parquet", str(tmp_path / "ds"), str(tmp_path / "pq")]) == 0
    assert len(list((tmp_path / "pq").glob("*.parquet"))) == 2
    (tmp_path / "ds" / "chunk-00001" / "x.memmap").write_bytes(b"\0" * 8)
    with pytest.raises(Exception, match="chunk-00001"):
        main(["verify", str(tmp_path / "ds")])


def test_prepare_openml(tmp_path, capsys, data_home):
    assert main(["prepare", "openml:magic", "--data-home", str(data_home), "--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip().endswith("magic-float32")
