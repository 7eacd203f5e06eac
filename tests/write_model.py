"""A model of an online shard's write stream, as :class:`rayrb.durability.writelog.WriteLog` assumes it, for tests without Ray."""


class ModelShard:
    """Rows land at positions ``first + i`` (a re-sent piece in the same place, once); the count covers
    contiguous rows, passing every run it reaches; rows beyond it are held, not counted."""

    def __init__(self):
        self.rows, self.ahead, self.written = {}, {}, 0

    def extend(self, first, rows):
        for i, r in enumerate(rows):
            self.rows.setdefault(first + i, r)
        if first > self.written:
            self.ahead[first] = first + len(rows)
            return
        self.written = max(self.written, first + len(rows))
        for a in sorted(self.ahead):
            if a > self.written:
                break
            self.written = max(self.written, self.ahead.pop(a))

    def write_state(self):
        """The count, and the runs of rows held beyond it (what ``OnlineShard.write_state`` reports)."""
        beyond, runs = sorted(p for p in self.rows if p >= self.written), []
        for p in beyond:
            if runs and runs[-1][1] == p:
                runs[-1] = (runs[-1][0], p + 1)
            else:
                runs.append((p, p + 1))
        return self.written, runs
