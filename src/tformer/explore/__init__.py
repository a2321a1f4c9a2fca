"""``tformer explore``: a page, served from this package alone, that shows a model's tokens, next-token choices and
attention, with the source document's mechanisms as switches (:mod:`tformer.explore.analysis` computes it,
:mod:`tformer.explore.server` serves it)."""
