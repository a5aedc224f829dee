"""`hpdl bench`'s commands, one module each: its options (``register``) and its run (``run``)."""
