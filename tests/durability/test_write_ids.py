"""A shard's journal of the writes it placed itself: answered again after a restart, other rows refused, lines of
rows that never counted dropped, torn and damaged lines skipped, bounded on disk."""
from __future__ import annotations

import pytest

from rayrb.durability.write_ids import FILE, Piece, WriteIds
from rayrb.errors import WriteIdError

pytestmark = pytest.mark.filterwarnings("error")


def test_a_piece_whose_rows_counted_is_answered_after_a_restart(tmp_path):
    ids = WriteIds(tmp_path, written=0)
    ids.add("a", 0, first=0, rows=4, start=0, digest="x")
    ids.add("b", 0, first=4, rows=3, start=0, digest="y")
    again = WriteIds(tmp_path, written=7)
    assert again.check("a", 0, 4, 0, "x") == Piece(0, 4, 0, "x")
    assert again.check("b", 0, 3, 0, None) == Piece(4, 3, 0, "y")  # no digest sent: the count and place decide
    assert again.check("c", 0, 3, 0, "z") is None


def test_a_piece_journalled_before_its_rows_counted_is_dropped_and_its_place_taken_again(tmp_path):
    ids = WriteIds(tmp_path, written=0)
    ids.add("a", 0, first=0, rows=4, start=0, digest="x")
    ids.add("lost", 0, first=4, rows=6, start=0, digest="y")  # the shard died before its count moved
    again = WriteIds(tmp_path, written=4)
    assert again.get("lost", 0) is None and again.get("a", 0) is not None
    again.add("lost", 0, first=4, rows=6, start=0, digest="y")  # the retry places it anew at the count there is
    assert WriteIds(tmp_path, written=10).get("lost", 0) == Piece(4, 6, 0, "y")


def test_a_piece_refused_after_its_line_is_passed_over_by_the_next_at_its_place(tmp_path):
    ids = WriteIds(tmp_path, written=0)
    ids.add("refused", 0, first=0, rows=5, start=0, digest="x")
    ids.forget(("refused", 0))  # its rows failed to store: the count never moved
    assert ids.get("refused", 0) is None
    ids.add("next", 0, first=0, rows=2, start=0, digest="y")
    again = WriteIds(tmp_path, written=2)
    assert again.get("refused", 0) is None and again.get("next", 0) == Piece(0, 2, 0, "y")


@pytest.mark.parametrize("other", [dict(rows=5), dict(start=2), dict(digest="other")])
def test_other_rows_under_a_used_id_are_refused(tmp_path, other):
    ids = WriteIds(tmp_path, written=0)
    ids.add("w", 0, first=0, rows=4, start=0, digest="x")
    asked = {"rows": 4, "start": 0, "digest": "x", **other}
    with pytest.raises(WriteIdError, match=r"'w'.*4 rows at row 0.*digest x"):
        ids.check("w", 0, asked["rows"], asked["start"], asked["digest"])
    with pytest.raises(WriteIdError):
        WriteIds(tmp_path, written=4).check("w", 0, asked["rows"], asked["start"], asked["digest"])


def test_a_torn_last_line_and_a_damaged_one_are_skipped_without_losing_the_others(tmp_path):
    ids = WriteIds(tmp_path, written=0)
    for i in range(4):
        ids.add(f"w{i}", 0, first=3 * i, rows=3, start=0, digest=str(i))
    path = tmp_path / FILE
    lines = path.read_text().splitlines(keepends=True)
    lines[1] = '["w1",0,Infinity,3,0,"1"]\n'  # a damaged line in the middle: JSON, with no int in it
    path.write_text("".join(lines) + '["w4",0,12,3,0,"4"')  # and a line torn by a crash mid-append
    again = WriteIds(tmp_path, written=12)
    assert [again.get(f"w{i}", 0) is not None for i in range(5)] == [True, False, True, True, False]
    assert path.read_text().count("\n") == 3  # rewritten without them
    assert all(line.startswith('["w') for line in path.read_text().splitlines())


def test_the_journal_remembers_its_last_pieces_and_stays_bounded_on_disk(tmp_path):
    ids = WriteIds(tmp_path, written=0, remember=8)
    for i in range(50):
        ids.add(f"w{i}", 0, first=i, rows=1, start=0, digest=None)
    assert len(ids) == 8 and ids.get("w41", 0) is None and ids.get("w42", 0) is not None
    assert (tmp_path / FILE).read_text().count("\n") <= 2 * 8
    again = WriteIds(tmp_path, written=50, remember=8)
    assert len(again) == 8 and again.get("w49", 0) == Piece(49, 1, 0, None)


def test_a_restore_clears_every_piece_and_the_file(tmp_path):
    ids = WriteIds(tmp_path, written=0)
    ids.add("w", 0, first=0, rows=4, start=0, digest="x")
    ids.clear()
    assert len(ids) == 0 and len(WriteIds(tmp_path, written=4)) == 0


def test_pieces_of_a_write_are_found_by_its_id_and_without_a_directory_kept_in_memory():
    ids = WriteIds(None, written=0)
    ids.add("w", 0, first=0, rows=4, start=0, digest="x")
    ids.add("w", 2, first=4, rows=4, start=8, digest="x")
    ids.add("v", 0, first=8, rows=1, start=0, digest="y")
    assert ids.of("w") == {0: Piece(0, 4, 0, "x"), 2: Piece(4, 4, 8, "x")}


def test_a_copy_that_took_another_copys_rows_answers_its_pieces_after_a_restart_too(tmp_path):
    """A primary that lost its files with its node takes its replica's rows and journal: the replica's pieces
    are answered from the primary's journal, on disk, and a writer's view of the files sees them."""
    for d in ("replica", "primary"):
        (tmp_path / d).mkdir()
    replica = WriteIds(tmp_path / "replica", written=0)
    replica.add("a", 0, first=0, rows=4, start=0, digest="x")
    replica.add("b", 0, first=4, rows=2, start=0, digest="y")
    replica.add("unwritten", 0, first=6, rows=3, start=0, digest="z")  # the replica's count never reached it
    primary = WriteIds(tmp_path / "primary", written=0)  # restarted empty
    writer = WriteIds(tmp_path / "primary", written=0, rewrite=False)
    primary.adopt(replica.to_array(), written=6)
    assert primary.get("a", 0) == Piece(0, 4, 0, "x") and primary.get("b", 0) == Piece(4, 2, 0, "y")
    assert primary.get("unwritten", 0) is None
    again = WriteIds(tmp_path / "primary", written=6)
    assert again.check("b", 0, 2, 0, "y") == Piece(4, 2, 0, "y")
    writer.sync(6)
    assert writer.get("a", 0) == Piece(0, 4, 0, "x")
    with pytest.raises(WriteIdError):  # the copy's pieces are held to their rows as this copy's are
        again.check("a", 0, 4, 0, "other")


def test_where_both_copies_placed_a_piece_at_one_place_this_copys_line_wins(tmp_path):
    (tmp_path / "mine").mkdir()
    mine = WriteIds(tmp_path / "mine", written=0)
    mine.add("a", 0, first=0, rows=2, start=0, digest="x")
    mine.add("mine", 0, first=2, rows=2, start=0, digest="m")
    theirs = WriteIds(None, written=0)
    theirs.add("a", 0, first=0, rows=2, start=0, digest="x")
    theirs.add("theirs", 0, first=2, rows=2, start=0, digest="t")
    theirs.add("later", 0, first=4, rows=1, start=0, digest="l")
    mine.adopt(theirs.to_array(), written=5)
    assert [mine.get(k, 0) is not None for k in ("a", "mine", "theirs", "later")] == [True, True, False, True]
    mine.adopt(None, written=5)  # a copy without a journal (an older state) changes nothing
    assert len(WriteIds(tmp_path / "mine", written=5)) == 3


def test_a_coordinators_journal_skips_lines_damaged_into_other_json(tmp_path):
    """Damaged lines are skipped, never read as writes: a number no int holds, or JSON of another shape (a string
    would unpack as the write 'x' with pieces 'y')."""
    from rayrb.durability.coordinator_state import CoordinatorState

    (tmp_path / "writes.log").write_text('["a",[[0,0,2,0]],null,0]\n["b",[[0,2,3,2]],null,1e400]\n"xyz"\n'
                                         '["c",[[0,"2",3,2]],null,3]\n')
    assert [w for w, _, _ in CoordinatorState(tmp_path).writes()] == ["a"]
