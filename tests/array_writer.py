"""A collector actor that writes dicts of numpy arrays, in a module that imports neither torch nor tensordict (an
actor's process imports the module its class comes from)."""
import sys

import numpy as np


class ArrayWriter:
    def write(self, client, start: int, n: int) -> tuple[list[int], list[str]]:
        """Write ``n`` rows; the slots, and which of torch and tensordict this process had imported by then."""
        rows = {"obs": np.full((n, 3), start, np.float32), "id": np.arange(start, start + n)}
        slots = client.extend(rows).tolist()
        return slots, sorted(m for m in ("torch", "tensordict") if m in sys.modules)
