"""The Lightning side: ``DPMPStrategy`` (``strategy``) and what it delegates to: checkpoint handling
(``strategy_checkpoint``), the precision/clipping hook (``hooks``), planning at setup (``autoplan``, ``stepdata``),
the multirun-safe launcher and a launched rank's lifecycle (``launcher``), the checks of the user's input
(``validate``), the replica guard (``guard``), metrics routing
(``metrics``), ZeRO (``zero``) and communication accounting (``accounting``).

May import: Lightning, torchmetrics, and every lower subpackage (``parallel``, ``planner``, ``checkpoint``).
"""
