"""Privacy machinery: secure-sum planning for Flower SecAgg+ (pure; Flower glue elsewhere)."""

from fedfields.privacy.secure_sum import (
    SecureAggregationConfig,
    SecureAggregationError,
    payload_layout,
)

__all__ = ["SecureAggregationConfig", "SecureAggregationError", "payload_layout"]
