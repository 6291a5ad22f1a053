//! Tests of the request language: examples, errors, round trips, fuzzing.
