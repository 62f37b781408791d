"""A pipe a worker thread writes to so that the engine core's loop, asleep in a poll, wakes up."""

from __future__ import annotations

import os


class Wakeup:
    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe()  # the loop polls `fd`
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)

    def notify(self) -> None:
        try:
            os.write(self._write_fd, b"\0")
        except OSError:
            pass  # the pipe is full (a wakeup is pending anyway) or closed at shutdown

    def clear(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.fd)
        os.close(self._write_fd)
