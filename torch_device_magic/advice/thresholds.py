"""Every threshold of "what to do", in one place: the notes under a cell and `%%profile`'s
rules read the same figures, so that a note and the profile's advice say the same thing.

Provenance of the profile's: "tb" is the removed TensorBoard profiler plugin's
(profiler/data.py of its last release), "HTA" Holistic Trace Analysis', "ours" ours;
docs/report.md and docs/profile.md list them for users.
"""

MiB = 2**20

# --- the notes under a cell (notes.py) ----------------------------------------------------
NEAR_CAPACITY_SHARE = 0.90  # a cell's device peak at this share of the device's memory
DISPLAYED_MIN_BYTES = 256 * MiB  # a displayed result this large is said (any device) ...
DISPLAYED_SHARE = 0.05  # ... and one holding this share of an accelerator's memory
INFERENCE_MIN_BYTES = 64 * MiB  # an autograd graph kept by an inference cell, this large
BUSY_MIN_S = 0.5  # a CUDA cell this long gets its GPU's busy share read (NVML) ...
BUSY_LOW = 50.0  # ... and a note below this percent busy
IDLE_MAX = 5.0  # at most this busy, while holding IDLE_HELD_BYTES: the GPU sat idle
IDLE_HELD_BYTES = 1024 * MiB
TRACEBACK_MIN_BYTES = 100 * MiB  # a failing cell's traceback keeps this much in its locals

# --- %%profile's rules (profile_rules.py) -------------------------------------------------
LOADER_SHARE = 0.05  # tb: the DataLoader's share of the wall
# ours: a DataLoader batch whose rows were indexed one at a time (this many index calls a
# batch or more: a TensorDataset's two tensors, two rows) is per-row indexing of tensors in
# memory where the rest of its time (ops other than indexing and stacking, and Python past
# this much a row's index call: the fetch loop and __getitem__ around it, 3 µs measured
# under the profiler on the 2-core machine) is under half of it
INDEXED_ROWS = 4
INDEX_GLUE_S = 20e-6
# ours: what a worker costs, measured there (torch 2.13, fork): 26 ms to the first batch with
# one worker, 135 ms with two; each batch handed back 1.2 ms (64 rows of 20 floats)
WORKER_START_S = 0.05  # a worker's start, each
WORKER_BATCH_S = 1e-3  # a batch handed back to the cell's process
DEVICE_BUSY = BUSY_LOW / 100  # tb (0.50): the device busy below this share of the wall
NEAR_CAPACITY = NEAR_CAPACITY_SHARE  # tb (0.90): the peak over this share of the device's memory
FRAGMENTED = 1.5  # ours: reserved over this many times the peak allocated
TENSOR_CORES = (7, 0)  # tb: the compute capability with tensor cores
PAGEABLE_BYTES = 1 << 20  # ours: pageable host-to-device copies worth pinning
TINY_HITS = 1000  # ours: a line calling the same op this many times...
# ...whose calls take under this (the median of the op's recorded calls: a few µs is torch's
# overhead, and a 128x128 matmul's 30 µs work; a busy machine's waits for a core stretch a
# few calls, not the median, while they stretched the line's wall a call ten times)...
TINY_CALL_S = 20e-6
TINY_SHARE = 0.10  # ...taking this share of the wall
CPU_OPS_SHARE = 0.20  # ours: torch's CPU work worth more threads
SHORT_KERNELS = 0.50  # HTA: the share of kernels shorter than their launch
WARM_UP_LINE = 0.50  # ours: a line this much of whose wall was first-call loading is warm-up
WARM_UP_WALL = 0.10  # ours: first-call loading worth saying, as a share of the wall ...
COLD_RUN = 0.50  # ... and at this share, the whole run was cold: no launch or host advice
DATA_PARALLEL_GPUS = 2  # tb: DataParallel on this many GPUs or more
# issue 39 (ours): the MFU said low under this (where the counted work is most of the
# device's busy time) and high from this; nanoGPT's well-tuned H100 runs read about 40-50%
MFU_LOW = 0.30
MFU_HIGH = 0.60
COUNTED_SHARE = 0.50  # the counted ops' kernels' share of the device's busy time
# issue 40 (ours): a launcher's ranks. A straggler: a rank whose own work in a step (outside
# collectives) is this many times the other ranks' median...
STRAGGLER_RATIO = 2.0
STRAGGLER_MIN_S = 0.002  # ...and at least this much more (and a quarter of a step)...
STRAGGLER_STEPS_SHARE = 0.75  # ...and the slowest rank in this share of the recorded steps
STRAGGLER_LATE_STEPS = 10  # or whose first step starts this many median steps late...
STRAGGLER_LATE_S = 0.1  # ...and at least this late
COLLECTIVE_SHARE = 0.50  # the ranks' median share of a step in collectives, said from this
UNEVEN_PEAK_RATIO = 1.5  # one rank's peak memory this many times another's...
UNEVEN_PEAK_BYTES = 256 * MiB  # ...and at least this much more


def capacity_share(peak_bytes: int | None, total_bytes: int | None) -> float | None:
    """The share of a device's memory a cell's peak took, where it is NEAR_CAPACITY_SHARE or
    more (else None): the one test behind the note under a cell and %%profile's rule 4,
    both given the same peak (`Measurement.device_top_bytes`)."""
    if not peak_bytes or not total_bytes:
        return None
    share = peak_bytes / total_bytes
    return share if share >= NEAR_CAPACITY_SHARE else None
