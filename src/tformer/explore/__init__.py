"""``tformer explore``: a page, served from this package alone, that shows a model's tokens, next-token choices and
attention, with the source document's mechanisms as switches, and the circuit views: the logit lens, head ablation
and activation patching (:mod:`tformer.explore.analysis` and :mod:`tformer.explore.probes` compute it,
:mod:`tformer.explore.server` serves it)."""
