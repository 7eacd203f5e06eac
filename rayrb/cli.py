"""The ``rayrb`` command: prepare, inspect, verify and export datasets; run the benchmark.

    rayrb prepare openml:shuttle --data-home ../shared/data
    rayrb info ~/.cache/rayrb/openml/shuttle-float32
    rayrb verify PATH
    rayrb export-parquet PATH DEST
    rayrb bench --smoke
"""
from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rayrb", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    prep = sub.add_parser("prepare", help="prepare a dataset id as a chunk dataset and print its path")
    prep.add_argument("dataset")
    prep.add_argument("--data-home", default=None)
    prep.add_argument("--root", default=None)
    prep.add_argument("--dtype", default="float32")
    for name in ("info", "verify"):
        sp = sub.add_parser(name, help=f"{name} a chunk dataset")
        sp.add_argument("path")
    ex = sub.add_parser("export-parquet", help="write a chunk dataset as Parquet, one file per chunk")
    ex.add_argument("path")
    ex.add_argument("dest")
    sub.add_parser("bench", help="run pipelines/benchmark.py (arguments pass through)", add_help=False)
    args, rest = p.parse_known_args(argv)

    from rayrb.chunks import ChunkDataset

    if args.cmd == "bench":
        script = Path(__file__).resolve().parents[1] / "pipelines" / "benchmark.py"
        if not script.is_file():
            print(f"rayrb bench needs a source checkout: {script} not found", file=sys.stderr)
            return 2
        sys.argv = [str(script), *rest]
        runpy.run_path(str(script), run_name="__main__")
        return 0
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "prepare":
        from rayrb.datasets.registry import load_dataset

        kw = {"data_home": args.data_home, "root": args.root, "dtype": args.dtype} \
            if args.dataset.startswith("openml:") else {}
        print(load_dataset(args.dataset, **kw).root)
    elif args.cmd == "info":
        ds = ChunkDataset.open(args.path)
        print(json.dumps({"root": str(ds.root), "rows": len(ds), "chunks": len(ds.chunks), "spec": ds.spec.to_json(),
                          "source": ds.source, "recipe": ds.recipe}, indent=1))
    elif args.cmd == "verify":
        ChunkDataset.open(args.path, verify=True)
        print(f"ok: {args.path}")
    elif args.cmd == "export-parquet":
        from rayrb.preprocess import export_parquet

        for f in export_parquet(args.path, args.dest):
            print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
