//! Pure collective plans (to be written).
