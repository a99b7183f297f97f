"""What every chapter script shares: launch detection, samplers, gathers, data, models, precision.

The chapter scripts in src/ch4/ keep the parallelism steps visible; the plumbing lives here once.
"""
