//! placeholder until the dispatcher tests land in the next step
