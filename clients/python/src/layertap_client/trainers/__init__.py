"""Drop-ins for drafter trainers' online modes: the trainer asks layertap for the hidden states
of the samples it trains on, with nothing written to disk.

- :mod:`layertap_client.trainers.speculators`: a hs-connectors hidden-states backend named
  ``layertap`` for speculators' trainer (``--hidden-states-backend layertap``).
- :mod:`layertap_client.trainers.specforge`: a ``FeatureSource`` for SpecForge's online
  rollout loop, and target models with the ``generate_eagle3_data`` /
  ``generate_dflash_data`` interface of SpecForge's scripts before 2026-07.

Each module imports its trainer when it is imported itself; this package imports none of
them. The tensors come from the layouts of :mod:`layertap_client.layouts`, the same
functions the offline converter uses.
"""

from ._servers import Servers

__all__ = ["Servers"]
