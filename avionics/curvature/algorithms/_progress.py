"""Progress bars for the long algorithms: a tqdm bar on stderr over a call's operator products.

``progress="auto"`` (the default of every algorithm that takes it) shows the bar only once the
call has run for :data:`DELAY` seconds (tqdm's ``delay``), so short calls print nothing;
``True`` shows it at once, ``False`` never. The bar advances by the columns of each product
``A @ X`` and is removed when the call returns. Under torch.distributed only rank 0 shows it
(every process runs the same products).
"""

from __future__ import annotations

import sys

import torch
from tqdm import tqdm

# Seconds a call with progress="auto" runs before its bar appears.
DELAY = 5.0


def check_progress(function: str, progress) -> None:
    """Raise a ValueError naming ``function`` unless ``progress`` is "auto", True or False."""
    if not (progress is True or progress is False or progress == "auto"):
        raise ValueError(
            f"{function}(progress={progress!r}): use 'auto' (a progress bar once the call has "
            f"run {DELAY:g} s), True (a bar at once) or False (none)."
        )


def progress_bar(progress, total: int, desc: str) -> tqdm:
    """A bar over ``total`` operator-vector products; ``progress`` as checked by
    :func:`check_progress`."""
    return tqdm(
        total=total,
        desc=desc,
        unit="product",
        file=sys.stderr,
        leave=False,
        delay=0.0 if progress is True else DELAY,
        disable=progress is False or _other_rank(),
    )


def _other_rank() -> bool:
    """Whether this process is a torch.distributed process other than rank 0."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_rank() != 0
