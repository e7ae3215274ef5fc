"""runtime/comm"""
