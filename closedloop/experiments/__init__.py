"""Controlled experiments over training runs: the four controls from one cold start
(``controls``), independent replicates pooled (``replicates``), and more evaluation attempts for
finished policies (``reevaluate``)."""
