"""The README's examples run as written (its ```pycon blocks, as doctests)."""
from __future__ import annotations

import doctest
import re

import pytest
from conftest import REPO


def pycon_blocks() -> list[str]:
    text = (REPO / "README.md").read_text()
    return re.findall(r"```pycon\n(.*?)```", text, re.S)


def test_the_readme_has_an_example():
    assert pycon_blocks()


@pytest.mark.usefixtures("ray_session")
def test_the_readme_examples_run(data_home, tmp_path, monkeypatch):
    from rayrb import load_dataset

    monkeypatch.setenv("RAYRB_HOME", str(tmp_path))  # prepared datasets go here, not to ~/.cache
    monkeypatch.chdir(REPO)  # the examples use ../shared/data, as from the checkout's root
    load_dataset("openml:adult_onehot", data_home=data_home, pbar=False)  # prepared once, quietly
    parser, runner = doctest.DocTestParser(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for i, block in enumerate(pycon_blocks()):
        runner.run(parser.get_doctest(block, {}, f"README block {i}", str(REPO / "README.md"), 0))
    assert runner.summarize(verbose=False).failed == 0
