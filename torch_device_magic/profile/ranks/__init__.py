"""One `%%profile` across a launcher's ranks, one module per concern:

- `launchers`: the launchers' entry points patched for the cell (`launches`), the
  session's folder of the ranks' traces (`RankFolders`);
- `child`: a rank's side, its function profiled, its trace and summary written (`Rank`);
- `summary`: a rank's figures, its summary file, the table and the straggler.
"""

from .launchers import FOLDERS, Launches, RankFolders, launches
from .summary import RankRecord, Straggler, read_ranks, straggler, table

__all__ = ["FOLDERS", "Launches", "RankFolders", "RankRecord", "Straggler", "launches",
           "read_ranks", "straggler", "table"]
