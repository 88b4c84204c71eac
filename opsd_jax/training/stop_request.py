"""A run's stop request: SIGTERM / SIGINT (preemption, Ctrl-C) end it cleanly after the current
step, on every process at the same step."""

from __future__ import annotations

import signal

from opsd_jax.parallel import distributed


class StopRequest:
    """SIGTERM / SIGINT (preemption, Ctrl-C) -> stop after the current step, save, exit 0.

    A second SIGINT falls back to Python's KeyboardInterrupt, for a user who really means it."""

    def __init__(self):
        self.signal_name = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    def requested(self) -> bool:
        """True when any process was signalled (all processes must stop at the same step)."""
        return bool(distributed.all_processes(self.signal_name is not None).any())
