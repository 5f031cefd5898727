"""What every framework callback does, framework and recording aside: one recording (an
`ActivationStats` or a `ParameterStats`) per fit, started at its start, one column per optimizer
step, the newest column as metrics every few steps, every rank's statistics merged at its end
when several processes train, hooks removed at its end or on an error, and a fit stopped cleanly
when the recording asks to stop (`on_nonfinite="raise"`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..arguments import count_argument


class FitRecorder:
    """The recording of one fit at a time, driven by a framework's events. A subclass says which
    recording it is and how to make, start, step, read and stop it."""

    # What the callback takes from the trainer, so never from the user.
    from_trainer: tuple[tuple[str, str], ...] = (("model", "the model that the trainer fits"),)
    # The recording's argument for the columns allocated up front.
    expected_argument: str

    def __init__(self, options: dict[str, Any], log_every_n_steps: Any) -> None:
        for name, taken in self.from_trainer:
            if name in options:
                raise TypeError(f"{name}: the callback hooks {taken}; omit it")
        self.options = self.checked(options)  # every argument checked now, not at fit start
        self.log_every_n_steps = (
            None
            if log_every_n_steps is None
            else count_argument(log_every_n_steps, "log_every_n_steps", 0)
        )
        self.recording: Any = None
        self.resume: dict[str, Any] | None = None  # a saved state to continue at the next fit
        # An error that stopped the fit (`on_nonfinite="raise"`): the framework is asked to stop,
        # and the error is raised at the end of the fit, once the hooks are removed.
        self.stopped_by: Exception | None = None
        self._steps = 0

    # What each recording does ---------------------------------------------------------------

    def checked(self, options: dict[str, Any]) -> dict[str, Any]:
        """The options, checked by making a recording of nothing with them."""
        raise NotImplementedError

    def create(self, *targets: Any, **options: Any) -> Any:
        """A recording of `targets` (what the framework trains) with `options`."""
        raise NotImplementedError

    def sink_folder(self, options: dict[str, Any]) -> str:
        """The folder under `<log_dir>/fasthooks` that a window's columns go to by default."""
        raise NotImplementedError

    def start(self, recording: Any) -> None:
        """Register the recording's hooks."""
        raise NotImplementedError

    def close_step(self, recording: Any) -> bool:
        """Close the column of an optimizer step; False when the fit must stop."""
        return True

    def metrics(self, recording: Any) -> dict[str, float]:
        """The newest column as scalars tagged for the framework's loggers."""
        raise NotImplementedError

    def stop(self, recording: Any) -> None:
        """Remove the recording's hooks; its statistics stay readable."""
        raise NotImplementedError

    # The fit --------------------------------------------------------------------------------

    def begin(
        self, *targets: Any, estimated_steps: float | None, log_dir: str | None = None
    ) -> None:
        """Start recording `targets` for a new fit, the buffers sized for the framework's
        estimate of its steps. With `window=` and no `sink=`, the columns go to a folder under
        the framework's `log_dir` (when it has one): `<log_dir>/fasthooks/<sink_folder>`."""
        self.abort()
        options = dict(self.options)
        if self.expected_argument not in options and _usable(estimated_steps):
            every = options.get("every", 1)
            options[self.expected_argument] = max(1, math.ceil(estimated_steps / every))
        if options.get("window") is not None and options.get("sink") is None and log_dir:
            options["sink"] = Path(log_dir) / "fasthooks" / self.sink_folder(options)
        recording = self.create(*targets, **options)
        if self.resume is not None:
            recording.load_state_dict(self.resume)
            self.resume = None
        self.recording = recording
        self.stopped_by = None
        self._steps = 0
        self.start(recording)

    def step(self, default_log_every: int) -> dict[str, float]:
        """At the end of an optimizer step: its metrics when they are due, else {}."""
        recording = self.recording
        if recording is None or self.stopped_by is not None or not self.close_step(recording):
            return {}
        self._steps += 1
        every = self.log_every_n_steps
        every = default_log_every if every is None else every
        if every <= 0 or self._steps % every:
            return {}
        return self.metrics(recording)

    def end(self) -> None:
        """At the end of a fit: merge every rank's statistics when several processes train,
        remove the hooks; then raise the error that stopped the fit, if one did."""
        recording = self.recording
        if recording is None:
            return
        try:
            if _several_processes():
                recording.all_reduce()  # every column held, with window= too
        finally:
            self.stop(recording)
        error, self.stopped_by = self.stopped_by, None
        if error is not None:
            raise error

    def abort(self) -> None:
        """After an error: remove the hooks, keep the statistics recorded so far."""
        if self.recording is not None:
            self.stop(self.recording)


def _usable(steps: float | None) -> bool:
    return steps is not None and math.isfinite(steps) and steps > 0


def _several_processes() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class RecordingCallback:
    """The user-facing side shared by every framework's callback."""

    _recorder: FitRecorder

    def __enter__(self) -> RecordingCallback:
        return self

    def __exit__(self, *exc: object) -> None:
        """Leaving a `with` block removes the hooks, also when training raised."""
        self._recorder.abort()
