//! Handle-indexed storage shared by the host backends: a handle is an index, and released
//! handles are never handed out again, so a stale one is reported as
//! [`Error::UnknownHandle`] instead of naming someone else's buffer.

use crate::Error;

/// The items of one kind (`bytes` or `table`) of one device.
#[derive(Debug)]
pub(crate) struct Handles<T> {
    kind: &'static str,
    device: &'static str,
    items: Vec<Option<T>>,
}

impl<T> Handles<T> {
    pub(crate) const fn new(kind: &'static str, device: &'static str) -> Handles<T> {
        Handles {
            kind,
            device,
            items: Vec::new(),
        }
    }

    fn unknown(kind: &'static str, device: &'static str, id: u32) -> Error {
        Error::UnknownHandle {
            kind,
            id,
            device: device.to_string(),
        }
    }

    pub(crate) fn get(&self, id: u32) -> Result<&T, Error> {
        self.items
            .get(id as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| Self::unknown(self.kind, self.device, id))
    }

    pub(crate) fn get_mut(&mut self, id: u32) -> Result<&mut T, Error> {
        let (kind, device) = (self.kind, self.device);
        self.items
            .get_mut(id as usize)
            .and_then(Option::as_mut)
            .ok_or_else(|| Self::unknown(kind, device, id))
    }

    /// The next handle number, or an error once `u32` is exhausted (checked before the
    /// item is made, so a refused allocation costs nothing).
    pub(crate) fn next(&self) -> Result<u32, Error> {
        u32::try_from(self.items.len()).map_err(|_| Error::BadArguments {
            op: "alloc",
            reason: "every handle number of this device has been used".to_string(),
        })
    }

    /// Stores `item` under the handle [`Handles::next`] returned.
    pub(crate) fn push(&mut self, item: T) -> u32 {
        self.items.push(Some(item));
        (self.items.len() - 1) as u32
    }

    /// Releases `id`.
    pub(crate) fn remove(&mut self, id: u32) -> Result<(), Error> {
        self.take(id).map(drop)
    }

    /// Releases `id` and hands back its item.
    pub(crate) fn take(&mut self, id: u32) -> Result<T, Error> {
        self.get(id)?;
        self.items[id as usize]
            .take()
            .ok_or_else(|| Self::unknown(self.kind, self.device, id))
    }

    /// Items stored and not yet released (a walk over every handle ever issued).
    pub(crate) fn live(&self) -> usize {
        self.items.iter().filter(|item| item.is_some()).count()
    }

    /// Takes every live item out (tear-down).
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        self.items.drain(..).flatten()
    }
}
