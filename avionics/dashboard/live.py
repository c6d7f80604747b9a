"""Live dashboard: redraw the figure every k steps while training goes on."""

from __future__ import annotations

import os
import threading

from avionics.dashboard.figure import plot
from avionics.dashboard.secondary import plot_secondary
from avionics.records.reader import as_run
from avionics.records.run import Run


class LiveDashboard:
    """Redraws the dashboard of a running training into image files every ``every`` steps.

    Drawing happens in a background thread, so :meth:`update` returns at once: when the
    previous drawing has not finished, that update is skipped (counted in ``skipped``)
    rather than waited for. Open the image in a viewer that reloads changed files.

    Args:
        source: the live ``Cockpit`` (its output is copied at the update, cheaply) or the
            path of the run log it writes (read in the background thread).
        path: the image file (.png, .pdf or .svg), rewritten at each redraw.
        every: redraw at the steps divisible by ``every``.
        secondary_path: also redraw the secondary screen into this file.

    Example::

        live = LiveDashboard(cockpit, "runs/exp1/cockpit.png", every=50)
        for step, (x, y) in enumerate(loader):
            ...  # the training step with the cockpit
            live.update(step)
        live.close()  # waits for the last drawing and draws the final state
    """

    def __init__(
        self,
        source,
        path: str | os.PathLike,
        every: int = 50,
        secondary_path: str | os.PathLike | None = None,
    ):
        if not isinstance(every, int) or every < 1:
            raise ValueError(
                f"every must be a positive int (steps between redraws), got {every!r}."
            )
        self.source = source
        self.path = path
        self.every = every
        self.secondary_path = secondary_path
        self.drawn = 0
        self.skipped = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _snapshot(self):
        if hasattr(self.source, "get_output"):
            return Run.from_output(self.source.get_output())
        return self.source  # a log path: read in the drawing thread

    def _draw(self, snapshot) -> None:
        try:
            run = as_run(snapshot)
            plot(run, self.path)
            if self.secondary_path is not None:
                plot_secondary(run, self.secondary_path)
            self.drawn += 1
        except BaseException as error:  # re-raised in the training thread at the next call
            self._error = error

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"The live dashboard failed to draw: {error}") from error

    def update(self, step: int) -> bool:
        """Start a redraw if ``step`` is due and the previous one has finished; return
        whether one was started."""
        self._raise_pending_error()
        if step % self.every != 0:
            return False
        if self._thread is not None and self._thread.is_alive():
            self.skipped += 1
            return False
        self._thread = threading.Thread(target=self._draw, args=(self._snapshot(),), daemon=True)
        self._thread.start()
        return True

    def close(self) -> None:
        """Wait for a drawing in progress, then draw the final state (blocking)."""
        if self._thread is not None:
            self._thread.join()
        self._raise_pending_error()
        self._draw(self._snapshot())
        self._raise_pending_error()
