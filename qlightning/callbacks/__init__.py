from qlightning.callbacks.ptq import PostTrainingQuantization, ptq_baseline
from qlightning.callbacks.qat import QuantizationAwareTraining

__all__ = ["PostTrainingQuantization", "QuantizationAwareTraining", "ptq_baseline"]
