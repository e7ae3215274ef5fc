"""runtime/training"""
