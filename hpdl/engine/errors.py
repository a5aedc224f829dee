"""Errors raised by the engine to callers."""


class HorovodInternalError(RuntimeError):
    """A collective failed on this rank: mismatched requests, a stalled or dead rank, a backend error.

    Named as in Horovod, so that scripts catching ``hvd.HorovodInternalError`` keep working.
    """
