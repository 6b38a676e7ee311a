"""Statistics of one attention call, as plan → paths → one reducer.

:mod:`.plan` decides once per call (scale groups, sampled rows, chunking, the path, facts proven
on the host) and the plan is carried to the call's backward; each module of :mod:`.paths`
computes per-row statistics (:class:`.rows.Rows`) and gradient rows for the calls it takes;
:mod:`.reduce` folds any path's rows into per-head values; :mod:`.forward` and :mod:`.backward`
are the entry points. :mod:`.reference` holds the plain formulas. Running state lives in
:mod:`probe.state`."""
