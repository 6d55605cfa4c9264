"""The MTP loss's public entry points, where DESIGN's contract names them; they are defined in
`mtp.train.loss` (the heads' loss, every path) and `mtp.train.targets` (windows into inputs and
each head's targets)."""

from mtp.train.loss import naive_mtp_loss, sequential_mtp_loss
from mtp.train.targets import mtp_inputs_targets

__all__ = ["mtp_inputs_targets", "naive_mtp_loss", "sequential_mtp_loss"]
