"""tformer as an lm-evaluation-harness model: ``--model tformer`` (lm-eval 0.4.13, the ``eval`` extra).

Importing this module registers the class with ``lm_eval.api.registry.register_model("tformer")``. The package also
declares it in the ``lm_eval.models`` entry-point group, which lm-eval's plugin discovery reads (merged upstream after
0.4.13). lm-eval 0.4.13 itself finds models only in its own table (``lm_eval/models/__init__.py``), so with it the
name must be registered in the process that runs the evaluation:

* from Python: ``import tformer.evaluation.lm_eval`` and then ``lm_eval.simple_evaluate(model="tformer",
  model_args="pretrained=smollm2", tasks=[...])``, or pass an instance: ``simple_evaluate(model=TformerLM(...))``;
* from the shell: ``python -m tformer.evaluation.lm_eval run --model tformer --model_args pretrained=smollm2
  --tasks arc_easy`` (lm-eval's own command line, after the registration). ``lm_eval --model tformer`` alone
  answers that no model has that name.

The three request types are answered with tformer's scorer (:mod:`tformer.evaluation.scoring`) and generator: the
numbers equal ``tformer eval``'s under ``--protocol lm-eval`` (tests/evaluation hold it on a local task).
"""

from __future__ import annotations

from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from tformer.evaluation import protocols
from tformer.evaluation.model import EvalModel, load
from tformer.evaluation.scoring import score_requests

DEFAULT_BATCH = 16
DEFAULT_GEN_TOKENS = 256  # lm-eval's max_gen_toks default


@register_model("tformer")
class TformerLM(TemplateLM):
    """``pretrained``: any checkpoint tformer loads (a path, ``smollm2``) or an :class:`EvalModel` / ``Pretrained``;
    ``batch_size``: distinct contexts scored together (``auto``: the default); ``max_length``: the longest input."""

    def __init__(
        self,
        pretrained: Any = "smollm2",
        batch_size: int | str = DEFAULT_BATCH,
        max_length: int | None = None,
        device: str = "cpu",
        dtype: str | None = None,
        **_: Any,
    ) -> None:
        super().__init__()
        import torch

        if str(device).startswith("cuda") and not torch.cuda.is_available():
            device = "cpu"  # lm-eval's command line passes cuda:0 by default; its HF model falls back the same way
        self.lm: EvalModel = load(pretrained, device=device or "cpu", dtype=dtype)
        self.lm.require("lm", "an lm-eval language-model task")
        text = str(batch_size)
        self.batch = int(text) if text.isdigit() and int(text) > 0 else DEFAULT_BATCH
        self._max_length = int(max_length) if max_length else self.lm.max_length

    # ---- what TemplateLM needs --------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.lm.eos if self.lm.eos is not None else self.lm.prefix

    @property
    def prefix_token_id(self) -> int:
        return self.lm.prefix

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.lm.name.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.lm.encode(string)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        from tformer.generation.chat import chat_prompt

        return chat_prompt(self.lm.tokenizer, chat_history, add_generation_prompt=add_generation_prompt)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None, **_):
        """``[(logprob, is_greedy)]`` of ``[((context, continuation), context ids, continuation ids)]``."""
        ids = [protocols.truncate(list(c), list(x), self._max_length) for _, c, x in requests]
        scored = score_requests(self.lm.model, ids, batch_size=override_bs or self.batch, pad_id=self.lm.pad_id)
        out = []
        for (key, _, _), s in zip(requests, scored, strict=True):
            answer = (s.logprob, s.greedy)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            out.append(answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text, by lm-eval's disjoint rolling windows."""
        windows, owner = [], []
        for i, req in enumerate(requests):
            for w in protocols.rolling_windows(self.tok_encode(req.args[0]), self.prefix_token_id, self._max_length):
                windows.append(w)
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, s in zip(
            owner, score_requests(self.lm.model, windows, batch_size=self.batch, pad_id=self.lm.pad_id), strict=True
        ):
            totals[i] += s.logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first of ``until`` (lm-eval's default: the EOS text)."""
        from tformer.generation.sampling import generate

        out = []
        for req in requests:
            context, kwargs = req.args[0], dict(req.args[1] or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", DEFAULT_GEN_TOKENS))
            ids = (
                self.tok_encode(context)[-(self._max_length - max_new) :]
                if self._max_length > max_new
                else self.tok_encode(context)
            )
            eos = [self.lm.eos] if self.lm.eos is not None else None
            new = generate(self.lm.model, [ids], max_new_tokens=max_new, greedy=True, eos_id=eos)[0]
            text = self.lm.tokenizer.decode(new)
            for stop in until:
                if stop and stop in text:
                    text = text.split(stop, 1)[0]
            self.cache_hook.add_partial("generate_until", (context, req.args[1]), text)
            out.append(text)
        return out


def main() -> None:
    """lm-eval's command line (``sys.argv``) with ``tformer`` registered: ``python -m tformer.evaluation.lm_eval
    run --model tformer ...``."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    setup_logging()
    parser = HarnessCLI()
    parser.execute(parser.parse_args())


if __name__ == "__main__":
    main()
