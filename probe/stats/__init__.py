"""Statistics: pure reductions (:mod:`.functional`), running state (:mod:`.accumulator`) and
the final metrics (:mod:`.finalize`)."""
