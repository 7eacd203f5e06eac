"""The ``rayrb`` command: prepare, inspect, verify, export and preprocess datasets; run the benchmark.

examples:
  rayrb prepare openml:shuttle --data-home ~/scikit_learn_data
  rayrb info ~/.cache/rayrb/openml/shuttle-float32
  rayrb verify ~/.cache/rayrb/openml/shuttle-float32
  rayrb export-parquet ~/.cache/rayrb/openml/shuttle-float32 /tmp/shuttle-parquet
  rayrb preprocess ~/.cache/rayrb/openml/shuttle-float32 /tmp/shuttle-std --fn my_fns:standardize --batched
  rayrb preprocess /mnt/rayrb/shuttle /mnt/rayrb/shuttle-std --fn my_fns:standardize --batched --address auto
  rayrb bench --smoke
  rayrb gc --dry-run

--address (every command): the Ray cluster to use ("auto", "host:6379", "ray://host:10001").
preprocess and bench start a local Ray without it. prepare, info, verify and export-parquet run in
this process without it and as one Ray task on the cluster with it (paths are then the cluster's).

exit status: 0 success, 1 failure (a chunk fails verification, fn raises, a path is missing),
2 usage error (unknown command or option, a --fn that cannot be imported).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import runpy
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rayrb.errors import InvalidArgumentError

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

EXAMPLES = {
    "prepare": "rayrb prepare openml:mushroom_onehot --data-home ~/scikit_learn_data --root /tmp/rayrb",
    "info": "rayrb info /tmp/rayrb/openml/mushroom_onehot-float32",
    "verify": "rayrb verify /tmp/rayrb/openml/mushroom_onehot-float32   # exit 1 if a chunk was altered",
    "export-parquet": "rayrb export-parquet /tmp/rayrb/openml/shuttle-float32 /tmp/shuttle-parquet",
    "preprocess": "rayrb preprocess /tmp/rayrb/openml/shuttle-float32 /tmp/shuttle-std --fn my_fns:standardize "
                  "--batched\n  (my_fns.py in the current directory: def standardize(td): ...; return td)",
    "bench": "rayrb bench --smoke --sections preprocess --out /tmp/bench",
    "gc": "rayrb gc --storage-dir /tmp/rayrb-state --dry-run",
}


# ---------------------------------------------------------------------------- the work of each command
# Module-level functions, so that with --address they run unchanged as Ray tasks on the cluster.
def prepare(dataset: str, data_home: str | None, root: str | None, dtype: str) -> str:
    from rayrb.io.chunks import MANIFEST, ChunkDataset
    from rayrb.io.datasets.openml import default_root
    from rayrb.io.datasets.registry import as_chunk_dataset, load_dataset
    from rayrb.io.files import replace_dir

    if dataset.startswith("openml:"):
        return str(load_dataset(dataset, data_home=data_home, root=root, dtype=dtype).root)
    prefix, _, name = dataset.partition(":")  # another loader's object (TorchRL's): its rows written as chunks
    folder = name.replace("/", "--")
    if folder in ("", ".", ".."):
        raise InvalidArgumentError(f"expected a dataset name after {prefix + ':'!r}, got {name!r}")
    dest = Path(root or default_root()) / prefix / folder
    if (dest / MANIFEST).is_file():  # prepared before: reused, as openml ids are
        return str(dest)
    loaded = load_dataset(dataset, batch_size=1)  # TorchRL's dataset classes require one; copying samples nothing
    if isinstance(loaded, ChunkDataset):
        return str(loaded.root)
    return str(replace_dir(dest, lambda d: as_chunk_dataset(loaded, root=d)))


def info(path: str) -> dict[str, Any]:
    from rayrb.io.chunks import ChunkDataset

    ds = ChunkDataset.open(path)
    return {"root": str(ds.root), "rows": len(ds), "chunks": len(ds.chunks), "spec": ds.spec.to_json(),
            "source": ds.source, "recipe": ds.recipe}


def verify(path: str) -> str:
    from rayrb.io.chunks import ChunkDataset

    ChunkDataset.open(path, verify=True)
    return f"ok: {path}"


def export(path: str, dest: str) -> list[str]:
    from rayrb.io.preprocess import export_parquet

    return [str(f) for f in export_parquet(path, dest)]


def load_function(spec: str) -> Callable:
    """``module:function`` -> the function (argparse type). The current directory is importable, as with -m."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise argparse.ArgumentTypeError(f"expected module:function, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise argparse.ArgumentTypeError(f"cannot import module {module_name!r} from {spec!r}: {e}") from None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if not callable(obj):
        raise argparse.ArgumentTypeError(f"expected a function {attr!r} in module {module_name!r}, "
                                         f"got {type(obj).__name__}")
    return obj


def _ship_by_value(fn: Callable) -> None:
    """A function from a file in the current directory is pickled by value: Ray workers need not import it."""
    import ray.cloudpickle

    module = sys.modules.get(getattr(fn, "__module__", ""))
    file = getattr(module, "__file__", None)
    if module is not None and file and Path(file).resolve().is_relative_to(Path.cwd().resolve()):
        ray.cloudpickle.register_pickle_by_value(module)


@contextlib.contextmanager
def connected(address: str | None) -> Iterator[Any]:
    """Ray, connected to ``address`` (or a new local instance); shut down after only if started here."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address=address, include_dashboard=False if address is None else None,
                 logging_level=logging.WARNING)
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()


def run_here_or_on(address: str | None, fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` in this process, or as one Ray task on the cluster at ``address``."""
    if address is None:
        return fn(*args)
    with connected(address) as ray:
        try:
            return ray.get(ray.remote(num_cpus=1)(fn).remote(*args))
        except ray.exceptions.RayTaskError as e:
            raise (e.cause if isinstance(e.cause, Exception) else e) from None


# ---------------------------------------------------------------------------- the parser
def parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--address", default=None, help="Ray cluster address (see `rayrb --help`)")
    p = argparse.ArgumentParser(prog="rayrb", description=__doc__, formatter_class=raw)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def add(name: str, help: str, **kw: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, epilog=f"example:\n  {EXAMPLES[name]}",
                              formatter_class=raw, parents=[common], **kw)

    sp = add("prepare", "prepare a dataset id as a chunk dataset and print its path")
    sp.add_argument("dataset", help="a dataset id, e.g. openml:shuttle")
    sp.add_argument("--data-home", default=None, help="scikit-learn data home holding the OpenML cache")
    sp.add_argument("--root", default=None, help="where prepared datasets go (default $RAYRB_HOME or ~/.cache/rayrb)")
    sp.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    add("info", "print a chunk dataset's rows, chunks, spec, source and recipe as JSON").add_argument("path")
    add("verify", "re-check every chunk's content hash; exit 1 naming the first that differs").add_argument("path")
    sp = add("export-parquet", "write a chunk dataset as Parquet, one file per chunk")
    sp.add_argument("path")
    sp.add_argument("dest")
    sp = add("preprocess", "map a dataset through a function with Ray tasks into a new chunk dataset")
    sp.add_argument("src", help="a chunk dataset, a dataset id, or a Parquet file or directory")
    sp.add_argument("dest", help="the new dataset's directory (absent, empty, or an interrupted run to resume)")
    sp.add_argument("--fn", required=True, type=load_function, metavar="MODULE:FUNCTION",
                    help="one row in, one row out (a TensorDict); with --batched one chunk in, one chunk out")
    sp.add_argument("--batched", action="store_true", help="call fn once per chunk (the fast path)")
    sp.add_argument("--num-workers", type=int, default=None, help="tasks in flight (default: the cluster's CPUs)")
    sp.add_argument("--chunk-rows", type=int, default=None, help="input rows per task and output chunk")
    sp.add_argument("--num-frames", type=int, default=None, help="transform only the first rows (to debug fn)")
    sp.add_argument("--no-resume", action="store_true", help="recompute chunks an interrupted run finished")
    sp = add("gc", "remove what buffers whose owner died without shutdown() left on this node")
    sp.add_argument("--storage-dir", action="append", default=None,
                    help="a buffer's storage_dir to search (default: the default one); may repeat")
    sp.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    add("bench", "run pipelines/benchmark.py (other arguments pass through)", add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    try:
        args, rest = p.parse_known_args(argv)
        if rest and args.cmd != "bench":
            p.error(f"unrecognized arguments: {' '.join(rest)}")
    except SystemExit as e:  # --help (0) or a usage error (2): argparse has printed why
        return int(e.code or 0)

    from rayrb.io.chunks import ChunkError
    from rayrb.io.datasets.openml import DatasetUnavailableError
    from rayrb.io.preprocess import PreprocessError

    try:
        return run(args, rest)
    except (ChunkError, PreprocessError, DatasetUnavailableError, OSError, ValueError, TypeError) as e:
        print(f"rayrb {args.cmd}: error: {e}", file=sys.stderr)
        return EXIT_FAILURE


def collect_leftovers(storage_dirs: list[str] | None, dry_run: bool) -> list[str]:
    """Version maps and state directories of buffers whose owner died without shutdown(), on this node."""
    from rayrb.actors.lifecycle import leftovers
    from rayrb.durability.leftovers import remove
    from rayrb.handle.owner import DEFAULT_STORAGE

    found = leftovers(storage_dirs or [DEFAULT_STORAGE])
    return [str(p) for p in (found if dry_run else remove(found))]


def run(args: argparse.Namespace, rest: list[str]) -> int:
    if args.cmd == "gc":
        for path in run_here_or_on(args.address, collect_leftovers, args.storage_dir, args.dry_run):
            print(path)
        return 0
    if args.cmd == "bench":
        script = Path(__file__).resolve().parents[1] / "pipelines" / "benchmark.py"
        if not script.is_file():
            print(f"rayrb bench needs a source checkout: {script} not found", file=sys.stderr)
            return EXIT_USAGE
        if args.address:
            os.environ["RAY_ADDRESS"] = args.address  # the benchmark connects to RAY_ADDRESS
        sys.argv = [str(script), *rest]
        runpy.run_path(str(script), run_name="__main__")
    elif args.cmd == "prepare":
        print(run_here_or_on(args.address, prepare, args.dataset, args.data_home, args.root, args.dtype))
    elif args.cmd == "info":
        print(json.dumps(run_here_or_on(args.address, info, args.path), indent=1))
    elif args.cmd == "verify":
        print(run_here_or_on(args.address, verify, args.path))
    elif args.cmd == "export-parquet":
        print("\n".join(run_here_or_on(args.address, export, args.path, args.dest)))
    elif args.cmd == "preprocess":
        from rayrb.io.preprocess import preprocess

        with connected(args.address):
            _ship_by_value(args.fn)
            out = preprocess(args.src, args.fn, args.dest, batched=args.batched, num_workers=args.num_workers,
                             chunk_rows=args.chunk_rows, num_frames=args.num_frames, resume=not args.no_resume)
        print(out.root)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
