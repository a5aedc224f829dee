"""The profiler's recording across ranks (``hvd.start_profile``, ``HPDL_PROFILE``): each rank's
engine events go to its recorder (hpdl/profile/recorder.py); the clocks' offsets (clock.py) and
the gathering and writing of every rank's records to one file (session.py) run through
hpdl.torch's collectives. ``hpdl profile`` reads the file (hpdl/profile/). See docs/profile.md.
"""
