from qlightning.callbacks.qat import QuantizationAwareTraining

__all__ = ["QuantizationAwareTraining"]
