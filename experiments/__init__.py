"""The studies of `mtp` (see README.md): run each as `python -m experiments.<study>` or
`python experiments/<study>.py`."""
