"""`fedfields audit`: utility versus leakage of finished runs, every pipeline side by side.

For each run directory the audit detects the pipeline from its config.json (scene, meta or
split), runs every attack and metric that applies (`fedfields.audit.scene`, `.meta`,
`.split`) on what the run kept, reading the ground truth its run-config names as the
experimenter, and reports one table (`format_table`), audit.json and audit.png per run
(`write_audit`). A deployed server never runs it.
"""

from fedfields.audit.pipeline import AuditConfig, AuditResult, RunError, open_run
from fedfields.audit.runs import audit_runs, format_table, plot_audit, write_audit

__all__ = [
    "AuditConfig",
    "AuditResult",
    "RunError",
    "audit_runs",
    "format_table",
    "open_run",
    "plot_audit",
    "write_audit",
]
