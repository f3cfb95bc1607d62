"""Conversions between the wire messages (``tokenmill.v1``) and the engine's in-process types.

Shared by every service that turns a request into engine work, so every pool reads the fields the same way.
"""

from __future__ import annotations

from tokenmill.v1 import common_pb2

from common.sampling import SamplingParams, StructuredOutput
from common.sequence import PriorityClass, Tenancy

_CLASSES: dict[int, PriorityClass] = {
    common_pb2.PRIORITY_CLASS_UNSPECIFIED: PriorityClass.STANDARD,
    common_pb2.PRIORITY_CLASS_INTERACTIVE: PriorityClass.INTERACTIVE,
    common_pb2.PRIORITY_CLASS_STANDARD: PriorityClass.STANDARD,
    common_pb2.PRIORITY_CLASS_BATCH: PriorityClass.BATCH,
}


def priority_class_from_proto(value: int) -> PriorityClass:
    """Unset: standard. Raises ValueError for a value this build does not know."""
    try:
        return _CLASSES[value]
    except KeyError:
        raise ValueError(f"priority_class {value} is unknown; use interactive, standard or batch") from None


def tenancy_from_meta(meta: common_pb2.RequestMeta) -> Tenancy:
    """The scheduler's view of a request's tenant (weight 0: 1.0; max_running 0: no cap).

    Raises ValueError naming the field for a negative weight or cap, or an unknown class."""
    if meta.tenant_weight < 0 or meta.tenant_max_running < 0:
        raise ValueError(f"tenant_weight ({meta.tenant_weight}) and tenant_max_running ({meta.tenant_max_running}) "
                         "must be >= 0 (0: the default)")
    return Tenancy(
        tenant=meta.tenant_id,
        klass=priority_class_from_proto(meta.priority_class),
        weight=meta.tenant_weight or 1.0,
        max_running=meta.tenant_max_running or None,
    )


def sampling_params_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take the documented defaults (max_tokens unset: up to the context limit).

    Does not validate: call ``SamplingParams.validate`` (ValueError naming the field and its range).
    """
    return SamplingParams(
        max_tokens=p.max_tokens if p.HasField("max_tokens") else None,
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_k=p.top_k if p.HasField("top_k") else None,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        min_p=p.min_p if p.HasField("min_p") else 0.0,
        presence_penalty=p.presence_penalty if p.HasField("presence_penalty") else 0.0,
        frequency_penalty=p.frequency_penalty if p.HasField("frequency_penalty") else 0.0,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        min_tokens=p.min_tokens,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=p.skip_special_tokens if p.HasField("skip_special_tokens") else True,
        logit_bias=tuple(p.logit_bias.items()),
        structured=structured_from_proto(p.structured) if p.HasField("structured") else None,
    )


def structured_from_proto(s: common_pb2.StructuredOutput) -> StructuredOutput | None:
    """The oneof's case; None when none is set (an empty StructuredOutput constrains nothing)."""
    kind = s.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not s.json_object):
        return None
    if kind == "choice":
        return StructuredOutput("choice", choices=tuple(s.choice.choices))
    if kind == "json_object":
        return StructuredOutput("json_object")
    return StructuredOutput(kind, spec=getattr(s, kind))


def structured_to_proto(so: StructuredOutput) -> common_pb2.StructuredOutput:
    if so.kind == "choice":
        return common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=list(so.choices)))
    if so.kind == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    if so.kind == "regex":
        return common_pb2.StructuredOutput(regex=so.spec)
    if so.kind == "grammar":
        return common_pb2.StructuredOutput(grammar=so.spec)
    return common_pb2.StructuredOutput(json_schema=so.spec)
