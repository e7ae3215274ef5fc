"""runtime/reporting"""
