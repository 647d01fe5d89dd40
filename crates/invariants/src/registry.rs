//! Declarations and the registry: every invariant of the process, by name, built once.

use crate::{Bucket, Error};
use once_cell::sync::OnceCell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A named invariant: what the rule is, never how often it broke (a [`crate::Scope`]
/// counts that). Declare one with [`crate::declare_invariant!`]; check it with
/// [`crate::Scope::expect`].
#[derive(Debug)]
pub struct Invariant {
    name: &'static str,
    bucket: Bucket,
    description: &'static str,
    module: &'static str,
    /// Its index in the process's [`registry`] (the counter slot of every scope); set once
    /// when the registry is built, `NO_SLOT` before and for an invariant not in it.
    slot: AtomicUsize,
}

const NO_SLOT: usize = usize::MAX;

impl Invariant {
    /// A new invariant (used by [`crate::declare_invariant!`]; `module` is where it is
    /// declared). One built by hand and not submitted to the registry is counted by no
    /// scope.
    pub const fn new(
        name: &'static str,
        bucket: Bucket,
        description: &'static str,
        module: &'static str,
    ) -> Self {
        Self {
            name,
            bucket,
            description,
            module,
            slot: AtomicUsize::new(NO_SLOT),
        }
    }

    /// The invariant's unique name, e.g. `swa.peer_mapped`.
    pub const fn name(&self) -> &'static str {
        self.name
    }

    /// How bad a breach is.
    pub const fn bucket(&self) -> Bucket {
        self.bucket
    }

    /// What the rule says, in one sentence.
    pub const fn description(&self) -> &'static str {
        self.description
    }

    /// The module that declared it.
    pub const fn module(&self) -> &'static str {
        self.module
    }

    /// Its counter slot in every scope, once the process's registry holds it.
    pub(crate) fn slot(&self) -> Option<usize> {
        Some(self.slot.load(Ordering::Relaxed)).filter(|&s| s != NO_SLOT)
    }
}

/// What [`crate::declare_invariant!`] submits to `inventory`.
#[derive(Debug)]
pub struct Declaration(pub &'static Invariant);

inventory::collect!(Declaration);

/// Every invariant declared in the process, by name.
#[derive(Debug)]
pub struct Registry {
    by_name: BTreeMap<&'static str, &'static Invariant>,
}

impl Registry {
    /// Builds a registry from declarations; refuses two different invariants with one
    /// name, naming both declaring modules. The same static submitted twice counts once.
    pub fn from_declarations<'a>(
        declarations: impl IntoIterator<Item = &'a Declaration>,
    ) -> Result<Registry, Error> {
        let mut by_name: BTreeMap<&'static str, &'static Invariant> = BTreeMap::new();
        for Declaration(invariant) in declarations {
            match by_name.get(invariant.name()) {
                Some(existing) if std::ptr::eq(*existing, *invariant) => {}
                Some(existing) => {
                    // Report in a stable order so the message does not depend on link order.
                    let (first, second) = if existing.module() <= invariant.module() {
                        (existing.module(), invariant.module())
                    } else {
                        (invariant.module(), existing.module())
                    };
                    return Err(Error::DuplicateInvariant {
                        name: invariant.name(),
                        first,
                        second,
                    });
                }
                None => {
                    by_name.insert(invariant.name(), invariant);
                }
            }
        }
        Ok(Registry { by_name })
    }

    /// The invariant with this name.
    pub fn get(&self, name: &str) -> Option<&'static Invariant> {
        self.by_name.get(name).copied()
    }

    /// Every invariant, sorted by name.
    pub fn iter(&self) -> impl Iterator<Item = &'static Invariant> + '_ {
        self.by_name.values().copied()
    }

    /// Every name, sorted.
    pub fn names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.by_name.keys().copied()
    }

    /// How many invariants are registered.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// Whether none is registered.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
}

static REGISTRY: OnceCell<Registry> = OnceCell::new();

/// The process's registry, built on first use from every linked declaration. Later calls,
/// from any thread, return the same registry and register nothing again. A duplicate
/// name is an error (and stays one: nothing is cached until the declarations are sound).
/// Building it gives each invariant its counter slot (its rank by name).
pub fn registry() -> Result<&'static Registry, Error> {
    REGISTRY.get_or_try_init(|| {
        let registry = Registry::from_declarations(inventory::iter::<Declaration>)?;
        for (slot, invariant) in registry.iter().enumerate() {
            invariant.slot.store(slot, Ordering::Relaxed);
        }
        Ok(registry)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    static A: Invariant = Invariant::new("t.a", Bucket::Guard, "a", "mod_one");
    static A_AGAIN: Invariant = Invariant::new("t.a", Bucket::Soften, "a again", "mod_two");
    static B: Invariant = Invariant::new("t.b", Bucket::Soften, "b", "mod_one");

    #[test]
    fn a_duplicate_name_is_refused_with_both_modules() {
        let decls = [Declaration(&A), Declaration(&B), Declaration(&A_AGAIN)];
        let err = Registry::from_declarations(&decls).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invariant \"t.a\" is declared twice: in mod_one and in mod_two"
        );
    }

    #[test]
    fn the_same_declaration_twice_registers_once() {
        let decls = [Declaration(&A), Declaration(&B), Declaration(&A)];
        let registry = Registry::from_declarations(&decls).unwrap();
        assert_eq!(registry.names().collect::<Vec<_>>(), ["t.a", "t.b"]);
    }

    #[test]
    fn the_registry_is_built_once_across_threads() {
        let first = registry().unwrap() as *const Registry as usize;
        let handles: Vec<_> = (0..8)
            .map(|_| std::thread::spawn(|| registry().unwrap() as *const Registry as usize))
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), first);
        }
        for (slot, invariant) in registry().unwrap().iter().enumerate() {
            assert_eq!(invariant.slot(), Some(slot), "{}", invariant.name());
        }
        let declared = inventory::iter::<Declaration>.into_iter().count();
        assert_eq!(
            registry().unwrap().len(),
            declared,
            "each declaration registered exactly once"
        );
    }
}
