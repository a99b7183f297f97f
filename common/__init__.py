"""What the chapter scripts run on: launch detection, flags, data and models, precision, checkpoints.

The scripts in src/ch4/ keep the steps they teach, torch's own calls among them, and import the rest from
here once. common/lessons/ holds the lessons written out from scratch and tested equal to PyTorch; no
module here imports one (tests/test_layout.py). The planning tools are a package of their own, planner/.
"""
