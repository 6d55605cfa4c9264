"""`python -m mtp.train.fit_help`: store the help of `mtp fit` and `mtp validate`."""

from mtp.train.fit_help import write

for path in write():
    print(f"wrote {path}")
