"""Hot sweeps: one loaded backend serves every point of a multirun; each point sets its batching through the control
file."""

from __future__ import annotations

import atexit
import logging
from dataclasses import replace
from typing import Optional

from backends.runtime.control import BatchingSettings, ControlFile
from backends.specs import BackendSpec, ModelSpec
from harness.app.batching import unloaded

log = logging.getLogger("harness.hot")  # the log channel's name, kept when the module moved


class HotBackends:
    """At most one loaded backend, reused while the points ask for the same backend and model."""

    def __init__(self) -> None:
        self.key: Optional[str] = None
        self.backend = None
        self.control: Optional[ControlFile] = None

    def get(self, spec: BackendSpec, model: ModelSpec):
        # How a batch is cut does not change what is loaded (harness/app/batching.py's unloaded)
        key = repr((replace(spec, **unloaded()), model))
        if key != self.key:
            self.close()
            from backends.start import make_backend

            settings = BatchingSettings(spec.max_tokens_per_microbatch, spec.micro_batch_size)
            self.control = ControlFile(initial=settings)
            self.backend = make_backend(spec, model)
            self.backend.attach_control(self.control)
            self.key = key
            log.info("hot: %s loaded once for the sweep; batching set through %s", spec.name, self.control.path)
        assert self.control is not None
        self.control.set_max_tokens_per_microbatch(spec.max_tokens_per_microbatch)
        self.control.set_micro_batch_size(spec.micro_batch_size)
        return self.backend

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
        if self.control is not None:
            self.control.remove()
        self.key, self.backend, self.control = None, None, None


# A global because the loaded backend must outlive each point: Hydra calls the task function once per
# point with the config alone. Point (harness/point/point.py) takes the backend from it; ReportCallback.on_multirun_end
# (harness/app/callbacks.py) closes it after the last point, and atexit when a sweep ends any other way.
HOT = HotBackends()
atexit.register(HOT.close)
